"""The micro-batch schedule of a train step, computed once for the whole step before any optimizer step runs.

A step's n samples are split, in order, into num_steps_per_rollout global batches (one optimizer step each). For
each global batch the schedule fixes which samples need no backward (their loss share is exactly 0, decided on
the global batch, see `zero_share_rows`) and how the rest are cut into micro-batches (lichen.train.micro_batches).
Deciding everything up front, centrally, is what a multi-rank trainer needs: each rank takes its share of the
same plans, so every rank runs the same number of micro-batches per optimizer step (uneven counts would hang
FSDP collectives) and no rank's skip decision differs from another's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lichen.train.micro_batches import Plan, PromptGroups, plan_micro_batches, row_width


@dataclass(frozen=True)
class MicroBatchPlanner:
    """How samples become micro-batches: by count, or by token budget with --use-dynamic-batch-size.

    No-grad passes (log-probs, values, forwards for metrics) hold no activations for a backward, so they take
    micro-batches twice as large as training's.
    """

    micro_batch_size: int
    max_tokens: int | None  # the token budget with --use-dynamic-batch-size, else None
    sort: bool = True  # length-sorted samples: similar lengths share micro-batches and rows
    pack: bool = True  # several samples per model row
    flops_coeff: float | None = None  # --balance-by-flops: micro-batches balanced by FLOPs (flops_balance)

    def train(self, indices: list[int], lengths: list[int], sharing: PromptGroups | None = None) -> list[Plan]:
        """`sharing`: the step's prompt groups, None when every sample computes its own prompt."""
        return plan_micro_batches(
            indices,
            lengths,
            micro_batch_size=self.micro_batch_size,
            max_tokens=self.max_tokens,
            sort=self.sort,
            pack=self.pack,
            sharing=sharing,
            flops_coeff=self.flops_coeff,
        )

    def no_grad(self, indices: list[int], lengths: list[int], sharing: PromptGroups | None = None) -> list[Plan]:
        return plan_micro_batches(
            indices,
            lengths,
            micro_batch_size=max(2 * self.micro_batch_size, 1),
            max_tokens=2 * self.max_tokens if self.max_tokens else None,
            sort=self.sort,
            pack=self.pack,
            sharing=sharing,
            flops_coeff=self.flops_coeff,
        )


@dataclass(frozen=True)
class OptimizerStepPlan:
    """One optimizer step: its global batch and the micro-batches each part of it runs in."""

    indices: list[int]  # the global batch (positions in the step's sample list)
    trained: list[Plan]  # forward + backward
    observed: list[Plan]  # skipped samples whose log-probs feed metrics: a no-grad forward only
    skipped: list[int]  # samples with no backward (observed or not computed at all)
    critic: list[Plan]  # the critic's micro-batches (--advantage-estimator ppo): the whole global batch
    record_log_probs: bool  # this step's training forward gives the trainer's log-probs for the mismatch metric

    @property
    def num_micro_batches(self) -> int:
        return len(self.trained) + len(self.observed)


def zero_share_rows(
    idx: list[int], mask: torch.Tensor, adv: torch.Tensor, *, zero_advantage_is_zero_loss: bool, needs_log_probs: bool
) -> tuple[list[int], list[int]]:
    """Rows of the global batch `idx` whose share of the loss is exactly 0 for any log-probs: no backward.

    A row whose loss mask is all 0 adds nothing to any aggregated term. A row whose advantage is 0 on every masked
    token adds exactly 0 to a built-in policy loss (each is -A times a finite, row-local factor), so it is skipped
    when `zero_advantage_is_zero_loss` (no entropy, KL loss, SFT / custom loss or custom reducer reads it).
    Denominators come from the whole global batch (lichen.train.train_batch.global_counts), so they still count
    skipped rows. Returns (skipped, observed): `observed` are the zero-advantage rows that still need a no-grad
    forward because their log-probs feed a metric (`needs_log_probs`); the rest are not computed at all.
    """
    live = mask[idx] != 0
    masked_out = ~live.any(dim=-1)
    zero_adv = torch.zeros_like(masked_out)
    if zero_advantage_is_zero_loss:
        zero_adv = ~((adv[idx] != 0) & live).any(dim=-1) & ~masked_out
    skipped = [i for i, m, z in zip(idx, masked_out.tolist(), zero_adv.tolist()) if m or z]
    observed = [i for i, z in zip(idx, zero_adv.tolist()) if z] if needs_log_probs else []
    return skipped, observed


def schedule_steps(
    planner: MicroBatchPlanner,
    lengths: list[int],
    mask: torch.Tensor,
    adv: torch.Tensor,
    *,
    num_steps: int,
    skip: bool,
    zero_advantage_is_zero_loss: bool,
    needs_log_probs: bool,
    record_first_log_probs: bool,
    with_critic: bool,
    sharing: PromptGroups | None = None,
) -> list[OptimizerStepPlan]:
    """The plan of every optimizer step of a train step over `len(lengths)` samples.

    `skip`: drop rows whose loss share is exactly 0 from the backward; `needs_log_probs`: the skipped rows' log-probs
    feed metrics of every step (ppo_kl against given old log-probs, TIS weights); `record_first_log_probs`: the first
    step's forward also gives the mismatch metric's log-probs (so its skipped rows are observed too); `sharing`:
    the step's prompt groups (lichen.train.micro_batches.PromptGroups), None to lay out every prompt per sample.
    """
    n = len(lengths)
    size = n // num_steps
    steps = []
    for k in range(num_steps):
        idx = list(range(k * size, (k + 1) * size))
        record = record_first_log_probs and k == 0
        skipped, observed = (
            zero_share_rows(
                idx,
                mask,
                adv,
                zero_advantage_is_zero_loss=zero_advantage_is_zero_loss,
                needs_log_probs=needs_log_probs or record,
            )
            if skip
            else ([], [])
        )
        dropped = set(skipped)
        trained = [i for i in idx if i not in dropped]
        steps.append(
            OptimizerStepPlan(
                indices=idx,
                trained=planner.train(trained, lengths, sharing),
                observed=planner.no_grad(observed, lengths, sharing),
                skipped=skipped,
                critic=planner.train(idx, lengths, sharing) if with_critic else [],
                record_log_probs=record,
            )
        )
    return steps


def plan_cost(plan: Plan, lengths: list[int], sharing: PromptGroups | None = None) -> int:
    """The padded token count a micro-batch computes: rows x its widest row (a shared prompt counted once)."""
    return len(plan) * max(row_width(row, lengths, sharing) for row in plan)


def split_across_ranks(
    plans: list[Plan],
    lengths: list[int],
    world_size: int,
    sharing: PromptGroups | None = None,
    flops_coeff: float | None = None,
) -> list[list[Plan | None]]:
    """The micro-batches of ONE global-batch schedule dealt to `world_size` ranks, balanced by padded tokens
    (with `flops_coeff`, --balance-by-flops: by estimated FLOPs, lichen.train.flops_balance.plan_flops).

    Longest-processing-time first: each micro-batch (largest first, ties in schedule order) goes to the rank with
    the fewest tokens so far (ties: the lowest rank). Every rank then gets the same number of entries, padded at the
    end with None: a rank runs an empty micro-batch there so FSDP's collectives stay matched (uneven counts hang
    them until the timeout). Every rank computes the same answer from the same inputs, so no rank has to send it.
    """
    shares: list[list[Plan | None]] = [[] for _ in range(world_size)]
    load = [0.0] * world_size
    cost: list[float]
    if flops_coeff is not None:
        from lichen.train.flops_balance import plan_flops

        cost = [plan_flops(plan, lengths, flops_coeff) for plan in plans]
    else:
        cost = [plan_cost(plan, lengths, sharing) for plan in plans]  # `sharing`: the layout's real positions
    order = sorted(range(len(plans)), key=lambda k: -cost[k])
    for k in order:
        r = min(range(world_size), key=lambda q: (load[q], q))
        shares[r].append(plans[k])
        load[r] += cost[k]
    most = max(len(s) for s in shares)
    return [s + [None] * (most - len(s)) for s in shares]
