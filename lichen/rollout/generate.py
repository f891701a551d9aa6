"""The default rollout: n samples per prompt from the engine, scored, shaped and (optionally) filtered.

`generate_rollout` is lichen's rollout function under the contract of lichen.rollout.base_types:
    generate_rollout(args, rollout_id, data_source, evaluation=False) -> RolloutFnTrainOutput(samples, metrics)
(with evaluation=True it is lichen's eval, lichen.rollout.eval.eval_rollout). A --rollout-function-path plug-in
replaces it and may call it. It reads lichen's RolloutConfig and engine from lichen.rollout.context.current() and
hands `args` only to the plug-ins it calls (reward, group filter, custom generate function).

One step: generate --n-samples-per-prompt samples per prompt, score them (lichen.rewards), add the DAPO overlong
penalty when --overlong-buffer-len is set (lichen.rollout.shaping). With --dynamic-sampling-filter-path the step
runs DAPO dynamic sampling, in rounds r = 0, 1, ...:
  - round 0 takes --rollout-batch-size prompts plus (--over-sampling-batch-size - --rollout-batch-size) further prompts
    from the data source; later rounds take --over-sampling-batch-size prompts each;
  - round r samples with seed key rollout_id * SEED_ROUND_STRIDE + r, so no two rounds share sampling seeds;
  - groups the filter keeps are collected until --rollout-batch-size are kept or --dynamic-sampling-max-rounds
    rounds ran.
Every prompt taken from the source is generated (the source hands out exactly the prompts asked for), so the
saved source position is exactly what an uninterrupted run would have reached. Over engine servers a round stops
once it has the groups the step lacks: later groups' requests are aborted (lichen.rollout.abort_surplus; the kept
groups are the same). With --partial-rollout the aborted groups go to the data source's buffer (PartialBuffer) and are
continued first next step (lichen.rollout.partial): round 0 then holds the buffered groups followed by
--over-sampling-batch-size minus that many new prompts. Kept groups beyond
--rollout-batch-size are discarded (counted and logged); their prompts are spent until the next epoch.
With fewer kept groups than --rollout-batch-size the step trains on fewer: the count is cut down to a multiple
the trainer can split into --num-steps-per-rollout equal global batches (filters.trainable_group_count); if that
leaves none, the first rejected groups fill up to the smallest splittable count (marked
metadata["dynamic_sampling_filler"] = True; under GRPO a group with equal rewards has zero advantage). Both cases
log a warning. The returned groups are renumbered: group_index = 0..k-1, index = group_index * n + j.
The step's metrics (dynamic sampling, overlong penalty, time/reward) are the output's `metrics`.
"""

from __future__ import annotations

import warnings
from typing import Any

from lichen.observe.metrics import get_logger
from lichen.rollout.abort_surplus import can_abort
from lichen.rollout.abort_surplus import generate_round as abort_surplus_round
from lichen.rollout.base_types import RolloutFnTrainOutput
from lichen.rollout.context import RolloutContext, current
from lichen.rollout.eval import eval_rollout
from lichen.rollout.filters import (
    load_group_filter,
    min_trainable_groups,
    renumber_groups,
    run_group_filter,
    trainable_group_count,
)
from lichen.rollout.partial import require_abortable
from lichen.rollout.samples import build_samples, score, shape
from lichen.rollout.shaping import overlong_metrics
from lichen.types import Sample

log = get_logger(__name__)

# Round r of rollout i samples with seed key i * SEED_ROUND_STRIDE + r: distinct for every (i, r) while
# r < SEED_ROUND_STRIDE, which is why --dynamic-sampling-max-rounds is capped at this value.
SEED_ROUND_STRIDE = 1000


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """lichen's rollout function (see the module docstring and lichen.rollout.base_types)."""
    if isinstance(data_source, list):  # called the old way, generate_rollout(args, rollout_id, prompts, manager)
        warnings.warn(
            "generate_rollout(args, rollout_id, prompts, manager) is deprecated; call "
            "generate_rollout(args, rollout_id, data_source)",
            DeprecationWarning,
            stacklevel=2,
        )
        manager, prompts = evaluation, data_source
        ctx = current()
        out = train_rollout(ctx, rollout_id, manager.data_source, prompts)
        ctx.metrics.update(out.metrics)
        return out.samples
    if evaluation:
        return eval_rollout(args, rollout_id, data_source)
    ctx = current()
    cfg = ctx.config
    reserved = len(data_source.buffer) if cfg.partial_rollout else 0
    # buffered groups take their places first: the data position moves by that many fewer
    prompts = data_source.get_prompts(cfg.data.batch_size - reserved)
    return train_rollout(ctx, rollout_id, data_source, prompts)


def train_rollout(ctx: RolloutContext, rollout_id: int, data_source: Any, prompts: list) -> RolloutFnTrainOutput:
    """One rollout step from `prompts` (--rollout-batch-size of them, fewer by the buffered groups)."""
    ctx.rollout_id = rollout_id
    if ctx.config.dynamic_sampling_filter_path:
        return _dynamic_sampling_rollout(ctx, rollout_id, data_source, prompts)
    groups, stats = _generate_scored(ctx, prompts, seed_key=rollout_id)
    metrics = {**overlong_metrics(s for g in groups for s in g), "time/reward": stats["reward_time_s"]}
    return RolloutFnTrainOutput(groups, metrics)


def _generate_scored(ctx: RolloutContext, prompts: list, *, seed_key: int) -> tuple[list[list[Sample]], dict]:
    """build_samples + score_samples + the overlong penalty; returns (groups, reward stats)."""
    groups = build_samples(ctx, prompts, ctx.config.sampling, seed_key=seed_key)
    samples = [s for g in groups for s in g]
    stats = score(ctx, samples)
    shape(ctx.config, samples)
    return groups, stats


def _dynamic_sampling_rollout(
    ctx: RolloutContext, rollout_id: int, data_source: Any, prompts: list
) -> RolloutFnTrainOutput:
    cfg = ctx.config
    args = ctx.args
    path = cfg.dynamic_sampling_filter_path
    group_filter = load_group_filter(path)
    target = cfg.data.batch_size
    per_round = cfg.over_sampling_batch_size
    max_rounds = cfg.dynamic_sampling_max_rounds
    n = cfg.sampling.n_samples_per_prompt
    steps = cfg.num_steps_per_rollout

    abortable = can_abort(cfg, ctx.engine)
    partial = None
    if cfg.partial_rollout:
        require_abortable(cfg, abortable)
        partial = data_source.buffer
    resumed = partial.take_all() if partial is not None else []
    resumed_tokens = sum(s.response_length for g in resumed for s in g)
    num_resumed = len(resumed)

    passed: list[list[Sample]] = []
    rejected: list[list[Sample]] = []
    reward_time, failed = 0.0, []
    generated = consumed = rounds = aborted = 0
    batch = list(prompts)
    batch += data_source.get_prompts(per_round - len(resumed) - len(batch))
    for r in range(max_rounds):
        if r > 0:
            batch, resumed = data_source.get_prompts(per_round), []
        consumed += len(batch)
        seed_key = rollout_id * SEED_ROUND_STRIDE + r
        if abortable:  # server engines: stop generating once enough groups are kept
            groups, keep, stats = abort_surplus_round(
                ctx,
                batch,
                seed_key=seed_key,
                group_filter=group_filter,
                need=target - len(passed),
                resumed=resumed,
                buffer=partial,
            )
            aborted += stats["aborted_groups"]
        else:
            groups, stats = _generate_scored(ctx, batch, seed_key=seed_key)
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
        log.info(
            "dynamic sampling: %d groups passed the filter beyond --rollout-batch-size %d; discarded (their "
            "prompts are spent for this epoch)",
            surplus,
            target,
        )
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
            len(passed),
            target,
            path,
            rounds,
            max_rounds,
            len(selected),
            why,
        )
    renumber_groups(selected)

    metrics = {
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
        **(
            {
                "rollout/partial_buffer_groups": len(partial),
                "rollout/partial_resumed_groups": num_resumed,
                "rollout/partial_resumed_tokens": resumed_tokens,
            }
            if partial is not None
            else {}
        ),
        **overlong_metrics(s for g in selected for s in g),
        "time/reward": reward_time,
    }
    return RolloutFnTrainOutput(selected, metrics)
