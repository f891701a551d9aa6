"""The default rollout: n samples per prompt from the engine, scored by the reward function.

A plug-in given by --rollout-function-path replaces `generate_rollout` with the same signature:
    fn(args, rollout_id: int, prompts: list[tuple[int, PromptRecord]], manager) -> list[list[Sample]]
where `manager` is the RolloutManager (it holds .engine, .tokenizer, .reward_fn, .encode(record)).
"""

from __future__ import annotations

import time

from lichen.engines.engine import GenRequest
from lichen.engines.sampling import derive_seed
from lichen.rewards import score_samples
from lichen.types import Sample, Status


def build_samples(args, manager, prompts, *, n: int, temperature: float, top_p: float, top_k: int,
                  max_new_tokens: int, seed_key: int) -> list[list[Sample]]:
    """Generate `n` samples for each prompt; a sample's seed is derive_seed(--seed, seed_key, prompt pos, j)."""
    requests, owners = [], []
    for pos, (data_index, record) in enumerate(prompts):
        ids = manager.encode(data_index, record)
        for j in range(n):
            requests.append(
                GenRequest(
                    input_ids=ids,
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    top_p=top_p,
                    top_k=top_k,
                    stop_token_ids=list(args.rollout_stop_token_ids or []),
                    seed=derive_seed(args.seed, seed_key, pos, j),
                )
            )
            owners.append((pos, j, data_index, record, ids))
    results = manager.engine.generate(requests)
    groups: list[list[Sample]] = [[] for _ in prompts]
    for (pos, j, data_index, record, ids), res in zip(owners, results):
        groups[pos].append(
            Sample(
                prompt=record.prompt,
                tokens=list(ids) + list(res.output_ids),
                response=manager.tokenizer.decode(res.output_ids, skip_special_tokens=True),
                response_length=len(res.output_ids),
                label=record.label,
                loss_mask=[1] * len(res.output_ids),
                rollout_log_probs=list(res.output_logprobs),
                status=Status.COMPLETED if res.finish_reason == "stop" else Status.TRUNCATED,
                weight_versions=[res.weight_version],
                metadata={**(record.metadata or {}), "prompt_index": data_index},
                group_index=pos,
                index=pos * n + j,
            )
        )
    return groups


def generate_rollout(args, rollout_id: int, prompts, manager) -> list[list[Sample]]:
    groups = build_samples(
        args,
        manager,
        prompts,
        n=args.n_samples_per_prompt,
        temperature=args.rollout_temperature,
        top_p=args.rollout_top_p,
        top_k=args.rollout_top_k,
        max_new_tokens=args.rollout_max_response_len,
        seed_key=rollout_id,
    )
    t0 = time.perf_counter()
    stats = score_samples([s for g in groups for s in g], manager.reward_fn, args)
    manager.last_reward_stats = {**stats, "reward_time_s": stats.get("reward_time_s", time.perf_counter() - t0)}
    return groups
