"""The default rollout: n samples per prompt from the engine, scored, shaped and (optionally) filtered.

A plug-in given by --rollout-function-path replaces `generate_rollout` with the same signature:
    fn(args, rollout_id: int, prompts: list[tuple[int, PromptRecord]], manager) -> list[list[Sample]]
where `manager` is the RolloutManager (it holds .engine, .tokenizer, .reward_fn, .encode(record), .source).

One step: generate --n-samples-per-prompt samples per prompt, score them (lichen.rewards), add the DAPO overlong
penalty when --overlong-buffer-len is set (lichen.rollout.shaping). With --dynamic-sampling-filter-path the step
runs DAPO dynamic sampling, in rounds r = 0, 1, ...:
  - round 0 takes the manager's batch plus (--over-sampling-batch-size - --rollout-batch-size) further prompts
    from `manager.source`; later rounds take --over-sampling-batch-size prompts each;
  - round r samples with seed key rollout_id * SEED_ROUND_STRIDE + r, so no two rounds share sampling seeds;
  - groups the filter keeps are collected until --rollout-batch-size are kept or --dynamic-sampling-max-rounds
    rounds ran.
Every prompt taken from the source is generated (the source hands out exactly the prompts asked for), so the
saved source position is exactly what an uninterrupted run would have reached. Over engine servers a round stops
once it has the groups the step lacks: later groups' requests are aborted (lichen.rollout.abort_surplus; the kept
groups are the same). With --partial-rollout the aborted groups go to the manager's PartialBuffer and are
continued first next step (lichen.rollout.partial): round 0 then holds the buffered groups followed by
--over-sampling-batch-size minus that many new prompts. Kept groups beyond
--rollout-batch-size are discarded (counted and logged); their prompts are spent until the next epoch.
With fewer kept groups than --rollout-batch-size the step trains on fewer: the count is cut down to a multiple
the trainer can split into --num-steps-per-rollout equal global batches (filters.trainable_group_count); if that
leaves none, the first rejected groups fill up to the smallest splittable count (marked
metadata["dynamic_sampling_filler"] = True; under GRPO a group with equal rewards has zero advantage). Both cases
log a warning. The returned groups are renumbered: group_index = 0..k-1, index = group_index * n + j.
Metrics for the step are left in `manager.last_rollout_extra`.
"""

from __future__ import annotations

import time

from lichen.engines.engine import GenRequest
from lichen.engines.sampler import derive_seed
from lichen.observe.metrics import get_logger
from lichen.rewards import score_samples
from lichen.rollout.abort_surplus import can_abort
from lichen.rollout.abort_surplus import generate_round as abort_surplus_round
from lichen.rollout.filters import (
    load_group_filter,
    min_trainable_groups,
    renumber_groups,
    run_group_filter,
    trainable_group_count,
)
from lichen.rollout.partial import require_abortable
from lichen.rollout.shaping import apply_overlong_penalty, overlong_metrics
from lichen.types import Sample, Status

log = get_logger(__name__)

# Round r of rollout i samples with seed key i * SEED_ROUND_STRIDE + r: distinct for every (i, r) while
# r < SEED_ROUND_STRIDE, which is why --dynamic-sampling-max-rounds is capped at this value.
SEED_ROUND_STRIDE = 1000


def response_budget(args, num_tokens: int, max_new_tokens: int) -> int:
    """Tokens a sample holding `num_tokens` may still generate: min(max_new_tokens, --rollout-max-context-len -
    num_tokens), slime's rule. The request carries it, so the in-process engine, lichen serve and SGLang all
    generate within the same budget; prompts with no room were dropped when the data loaded (lichen.data.fit)."""
    context = getattr(args, "rollout_max_context_len", None)  # None: args built by hand, without validation
    return max_new_tokens if context is None else min(max_new_tokens, context - num_tokens)


def build_samples(args, manager, prompts, *, n: int, temperature: float, top_p: float, top_k: int,
                  max_new_tokens: int, seed_key: int) -> list[list[Sample]]:
    """Generate `n` samples for each prompt; a sample's seed is derive_seed(--seed, seed_key, prompt pos, j)."""
    if getattr(args, "custom_generate_function_path", None):  # each sample made by the user's async function
        from lichen.rollout.custom_generate import build_custom_samples

        return build_custom_samples(args, manager, prompts, n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                                    max_new_tokens=max_new_tokens, seed_key=seed_key)
    requests, owners = sample_requests(args, manager, prompts, n=n, temperature=temperature, top_p=top_p,
                                       top_k=top_k, max_new_tokens=max_new_tokens, seed_key=seed_key)
    results = manager.engine.generate(requests)
    groups: list[list[Sample]] = [[] for _ in prompts]
    for owner, res in zip(owners, results):
        groups[owner[0]].append(make_sample(manager, owner, res, n))
    return groups


def sample_requests(args, manager, prompts, *, n: int, temperature: float, top_p: float, top_k: int,
                    max_new_tokens: int, seed_key: int, first_pos: int = 0) -> tuple[list[GenRequest], list[tuple]]:
    """The engine requests of `build_samples`, and per request its owner (pos, j, data_index, record, ids); the
    prompts take round positions first_pos, first_pos + 1, ... (resumed partial groups come before them)."""
    requests, owners = [], []
    for pos, (data_index, record) in enumerate(prompts, start=first_pos):
        ids = manager.encode(data_index, record)
        for j in range(n):
            requests.append(
                GenRequest(
                    input_ids=ids,
                    max_new_tokens=response_budget(args, len(ids), max_new_tokens),
                    temperature=temperature,
                    top_p=top_p,
                    top_k=top_k,
                    stop_token_ids=list(args.rollout_stop_token_ids or []),
                    seed=derive_seed(args.seed, seed_key, pos, j),
                )
            )
            owners.append((pos, j, data_index, record, ids))
    return requests, owners


def make_sample(manager, owner: tuple, res, n: int) -> Sample:
    """The Sample for one engine result of `sample_requests`."""
    pos, j, data_index, record, ids = owner
    return Sample(
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


def generate_rollout(args, rollout_id: int, prompts, manager) -> list[list[Sample]]:
    """One rollout step: `prompts` (the manager's batch) -> scored, shaped groups; see the module docstring."""
    if getattr(args, "dynamic_sampling_filter_path", None):
        return _dynamic_sampling_rollout(args, rollout_id, prompts, manager)
    groups, stats = _generate_scored(args, manager, prompts, seed_key=rollout_id)
    manager.last_reward_stats = stats
    manager.last_rollout_extra = overlong_metrics(s for g in groups for s in g)
    return groups


def _generate_scored(args, manager, prompts, *, seed_key: int) -> tuple[list[list[Sample]], dict]:
    """build_samples + score_samples + the overlong penalty; returns (groups, reward stats)."""
    groups = build_samples(
        args,
        manager,
        prompts,
        n=args.n_samples_per_prompt,
        temperature=args.rollout_temperature,
        top_p=args.rollout_top_p,
        top_k=args.rollout_top_k,
        max_new_tokens=args.rollout_max_response_len,
        seed_key=seed_key,
    )
    samples = [s for g in groups for s in g]
    t0 = time.perf_counter()
    stats = score_samples(samples, manager.reward_fn, args)
    stats = {**stats, "reward_time_s": stats.get("reward_time_s", time.perf_counter() - t0)}
    buffer_len = getattr(args, "overlong_buffer_len", None)
    if buffer_len is not None:
        # after scoring, before any filter: the filter sees the reward the trainer will see
        apply_overlong_penalty(samples, max_response_len=args.rollout_max_response_len, buffer_len=buffer_len,
                               factor=args.overlong_penalty_factor, reward_key=args.reward_key)
    return groups, stats


def take_prompts(source, count: int) -> list:
    """Exactly the next `count` prompts of a PromptSource, advancing its position by `count`.

    PromptSource.next_batch hands out `source.batch_size` prompts; it is set to `count` for one call, so the
    position moves by exactly the prompts that will be generated (and a resumed run continues from there).
    """
    if count <= 0:
        return []
    saved = source.batch_size
    source.batch_size = count
    try:
        return source.next_batch()
    finally:
        source.batch_size = saved


def _dynamic_sampling_rollout(args, rollout_id: int, prompts, manager) -> list[list[Sample]]:
    path = args.dynamic_sampling_filter_path
    group_filter = load_group_filter(path)
    target = args.rollout_batch_size
    per_round = getattr(args, "over_sampling_batch_size", None) or target
    max_rounds = args.dynamic_sampling_max_rounds
    n = args.n_samples_per_prompt
    steps = getattr(args, "num_steps_per_rollout", None) or 1

    abortable = can_abort(args, manager)
    partial = None
    if getattr(args, "partial_rollout", False):
        require_abortable(args, abortable)
        partial = manager.partial
    resumed = partial.take_all() if partial is not None else []
    resumed_tokens = sum(s.response_length for g in resumed for s in g)
    num_resumed = len(resumed)

    passed: list[list[Sample]] = []
    rejected: list[list[Sample]] = []
    reward_time, failed = 0.0, []
    generated = consumed = rounds = aborted = 0
    batch = list(prompts)
    batch += take_prompts(manager.source, per_round - len(resumed) - len(batch))
    for r in range(max_rounds):
        if r > 0:
            batch, resumed = take_prompts(manager.source, per_round), []
        consumed += len(batch)
        seed_key = rollout_id * SEED_ROUND_STRIDE + r
        if abortable:  # server engines: stop generating once enough groups are kept
            groups, keep, stats = abort_surplus_round(args, manager, batch, seed_key=seed_key,
                                                      group_filter=group_filter, path=path, need=target - len(passed),
                                                      resumed=resumed, buffer=partial)
            aborted += stats["aborted_groups"]
        else:
            groups, stats = _generate_scored(args, manager, batch, seed_key=seed_key)
            keep = run_group_filter(group_filter, args, groups, path)
        reward_time += stats["reward_time_s"]
        failed += stats.get("failed", [])
        for group, k in zip(groups, keep):
            for s in group:
                s.metadata["dynamic_sampling_round"] = r
            (passed if k else rejected).append(group)
        generated += len(groups)
        rounds = r + 1
        if len(passed) >= target:
            break

    selected = passed[:target]
    surplus = len(passed) - len(selected)
    if surplus:
        log.info("dynamic sampling: %d groups passed the filter beyond --rollout-batch-size %d; discarded (their "
                 "prompts are spent for this epoch)", surplus, target)
    uneven = fillers = 0
    if len(selected) < target:
        trainable = trainable_group_count(len(selected), n, steps)
        if trainable == 0:
            fillers = min_trainable_groups(n, steps) - len(selected)
            for group in rejected[:fillers]:
                for s in group:
                    s.metadata["dynamic_sampling_filler"] = True
            selected += rejected[:fillers]
        else:
            uneven = len(selected) - trainable
            selected = selected[:trainable]
        if fillers:
            why = f" ({fillers} of them rejected groups, filling up to the smallest batch the trainer can split)"
        elif uneven:
            why = f" (cut by {uneven} so that --num-steps-per-rollout {steps} splits them evenly)"
        else:
            why = ""
        log.warning(
            "dynamic sampling: only %d of %d groups passed --dynamic-sampling-filter-path %s in %d round(s) "
            "(--dynamic-sampling-max-rounds %d); training this step on %d groups%s",
            len(passed), target, path, rounds, max_rounds, len(selected), why,
        )
    renumber_groups(selected)

    manager.last_reward_stats = {"reward_time_s": reward_time, "num_failed": len(failed), "failed": failed}
    manager.last_rollout_extra = {
        "rollout/dynamic_sampling_rounds": rounds,
        "rollout/dynamic_sampling_prompts": consumed,
        "rollout/dynamic_sampling_generated_groups": generated,
        "rollout/dynamic_sampling_passed_groups": len(passed),
        "rollout/dynamic_sampling_dropped_groups": len(rejected),
        "rollout/dynamic_sampling_discarded_groups": surplus + uneven,
        "rollout/dynamic_sampling_filler_groups": fillers,
        "rollout/dynamic_sampling_aborted_groups": aborted,
        "rollout/dynamic_sampling_kept_groups": len(selected),
        "rollout/dynamic_sampling_pass_rate": len(passed) / max(generated, 1),
        **({"rollout/partial_buffer_groups": len(partial), "rollout/partial_resumed_groups": num_resumed,
            "rollout/partial_resumed_tokens": resumed_tokens} if partial is not None else {}),
        **overlong_metrics(s for g in selected for s in g),
    }
    return selected
