"""The metrics phase of a train step: per-optimizer-step totals averaged over the step, plus the checks.

Besides the loss terms this reports the mismatch between the engine's and the trainer's log-probs for the same
tokens and weights (train/train_rollout_logprob_abs_diff), and warns when the first step's ppo_kl, with
recomputed old log-probs, is not ~0 (the trainer's log-probs would depend on how samples are batched).
"""

from __future__ import annotations

import torch

from lichen.errors import RunError
from lichen.observe.metrics import get_logger
from lichen.train.train_batch import TrainBatch
from lichen.types import Status

log = get_logger(__name__)


def step_metrics(
    tb: TrainBatch, per_step: list[dict], trainer_log_probs: torch.Tensor | None, recomputed_old: bool
) -> dict:
    """Metrics of a train step from the per-optimizer-step totals `per_step`; `trainer_log_probs` [n, R] are the
    trainer's for the mismatch metric (None without engine log-probs)."""
    metrics: dict = {}
    if tb.rollout_log_probs is not None and trainer_log_probs is not None:
        diff = (trainer_log_probs - tb.rollout_log_probs).abs() * tb.mask
        metrics["train/train_rollout_logprob_abs_diff"] = float(diff.sum() / tb.mask.sum().clamp(min=1))
        metrics["train/train_rollout_logprob_abs_diff_max"] = float(diff.max())
    for key in per_step[0]:
        metrics[f"train/{key}"] = sum(m[key] for m in per_step) / len(per_step)
    if "ppo_kl" in per_step[0]:
        metrics["train/ppo_kl_first_step"] = per_step[0]["ppo_kl"]
        metrics["train/ppo_kl_last_step"] = per_step[-1]["ppo_kl"]
    metrics["train/num_failed_samples"] = sum(s.status == Status.FAILED for s in tb.samples)
    if recomputed_old and abs(metrics["train/ppo_kl_first_step"]) > 1e-4:
        log.warning(
            "invariant: first-step ppo_kl = %.3g with recomputed old log-probs (expected ~0): the trainer's "
            "log-probs depend on how samples are batched",
            metrics["train/ppo_kl_first_step"],
        )
    return metrics


def check_mismatch(metrics: dict, threshold: float | None, rollout_id: int) -> None:
    """--ci-train-rollout-logprob-abs-diff-threshold (slime's --ci-test assertion): a RunError naming the step, the
    value and the flag when the step's train/train_rollout_logprob_abs_diff exceeds `threshold`. A step without
    engine log-probs has no such metric and passes, as in slime. Every trainer rank computes the same metrics, so
    every rank raises alike."""
    value = metrics.get("train/train_rollout_logprob_abs_diff")
    if threshold is None or value is None or value <= threshold:
        return
    raise RunError(
        f"step {rollout_id + 1}: train/train_rollout_logprob_abs_diff = {value:.6g} exceeds "
        f"--ci-train-rollout-logprob-abs-diff-threshold {threshold:g}: the trainer's log-probs of the rollout's "
        "tokens differ from the engine's by more than the bound (different weights, numerics or sampling "
        "settings between trainer and engine); raise the bound or drop the flag to go on"
    )
