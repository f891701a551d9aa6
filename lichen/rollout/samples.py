"""One batch of prompts -> Samples: engine requests, the Samples made from their results, scoring and shaping.

Shared by every generation path: the default rollout, dynamic-sampling rounds, eval.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from lichen.engines.core.engine import GenRequest, GenResult
from lichen.engines.core.sampler import derive_seed, truncates
from lichen.rewards import score_samples
from lichen.rollout.context import RolloutContext
from lichen.rollout.custom_generate import build_custom_samples
from lichen.rollout.sample_hooks import apply_sample_hooks
from lichen.rollout.shaping import apply_overlong_penalty
from lichen.types import Sample, Status

if TYPE_CHECKING:
    from lichen.config.rollout_config import RolloutConfig

Encode = Callable[[int, Any], list[int]]  # (data index, record) -> prompt ids


def sample_requests(
    sampling: Any, prompts: list, encode: Encode, *, seed_key: int, first_pos: int = 0
) -> tuple[list[GenRequest], list[tuple]]:
    """`sampling.n_samples_per_prompt` requests per prompt, and per request its owner (pos, j, data_index, record,
    ids); a sample's seed is derive_seed(--seed, seed_key, pos, j). The prompts take round positions first_pos,
    first_pos + 1, ... (resumed partial groups come before them)."""
    requests, owners = [], []
    for pos, (data_index, record) in enumerate(prompts, start=first_pos):
        ids = encode(data_index, record)
        for j in range(sampling.n_samples_per_prompt):
            requests.append(
                GenRequest(
                    input_ids=ids,
                    max_new_tokens=sampling.response_budget(len(ids), sampling.max_response_len),
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    top_k=sampling.top_k,
                    stop_token_ids=list(sampling.stop_token_ids),
                    seed=derive_seed(sampling.seed, seed_key, pos, j),
                    # sampling-mask replay (docs/architecture.md#log-prob-convention): with top-p / top-k the
                    # trainer scores each token over the set the engine kept
                    return_sampling_mask=truncates(sampling.top_p, sampling.top_k),
                )
            )
            owners.append((pos, j, data_index, record, ids))
    return requests, owners


def make_sample(tokenizer: Any, owner: tuple, res: GenResult, n: int) -> Sample:
    """The Sample for one engine result of `sample_requests`."""
    pos, j, data_index, record, ids = owner
    return Sample(
        prompt=record.prompt,
        tokens=list(ids) + list(res.output_ids),
        response=tokenizer.decode(res.output_ids, skip_special_tokens=True),
        response_length=len(res.output_ids),
        label=record.label,
        loss_mask=[1] * len(res.output_ids),
        rollout_log_probs=list(res.output_logprobs),
        rollout_sampling_mask=res.sampling_mask,
        status=Status.COMPLETED if res.finish_reason == "stop" else Status.TRUNCATED,
        weight_versions=[res.weight_version],
        metadata={**(record.metadata or {}), "prompt_index": data_index, **engine_of(res)},
        group_index=pos,
        index=pos * n + j,
    )


def engine_of(res: GenResult) -> dict:
    """{"engine": the server's URL} for a sample's metadata, {} for the in-process engine; the sample log shows it.
    A sample made by several engine calls (turns, resumed segments) lists one entry per call instead."""
    return {"engine": res.engine} if res.engine else {}


def build_samples(
    ctx: RolloutContext, prompts: list, sampling: Any, *, seed_key: int, encode: Encode | None = None
) -> list[list[Sample]]:
    """Generate `sampling.n_samples_per_prompt` samples for each prompt; a sample's seed is
    derive_seed(--seed, seed_key, prompt pos, j). `encode` defaults to the training prompts' encoding."""
    encode = encode or ctx.encode
    if ctx.config.custom_generate_function_path:  # each sample made by the user's async function
        return build_custom_samples(ctx, prompts, sampling, seed_key=seed_key, encode=encode)
    requests, owners = sample_requests(sampling, prompts, encode, seed_key=seed_key)
    results = ctx.engine.generate(requests)
    groups: list[list[Sample]] = [[] for _ in prompts]
    for owner, res in zip(owners, results):
        groups[owner[0]].append(make_sample(ctx.tokenizer, owner, res, sampling.n_samples_per_prompt))
    return groups


def score(ctx: RolloutContext, samples: list[Sample], reward_fn: Any = None, *, evaluation: bool = False) -> dict:
    """score_samples with the configured limits, after the --rollout-sample-hook-path hooks (lichen.rollout.
    sample_hooks; `ctx.rollout_id` and `evaluation` are handed to them); stats always carry reward_time_s."""
    reward = ctx.config.reward
    apply_sample_hooks(reward.sample_hook_paths, ctx.args, samples, rollout_id=ctx.rollout_id, evaluation=evaluation)
    t0 = time.perf_counter()
    stats = score_samples(
        samples, reward_fn or ctx.reward_fn, ctx.args, concurrency=reward.concurrency, timeout=reward.timeout
    )
    return {**stats, "reward_time_s": stats.get("reward_time_s", time.perf_counter() - t0)}


def shape(cfg: RolloutConfig, samples: list[Sample]) -> None:
    """The DAPO overlong penalty, when --overlong-buffer-len is set; after scoring, before any filter, so the
    filter sees the reward the trainer will see."""
    if cfg.overlong_buffer_len is not None:
        apply_overlong_penalty(
            samples,
            max_response_len=cfg.sampling.max_response_len,
            buffer_len=cfg.overlong_buffer_len,
            factor=cfg.overlong_penalty_factor,
            reward_key=cfg.reward.reward_key,
        )
