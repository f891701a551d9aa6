"""Learning-rate schedule: linear warm-up, then constant / linear / cosine decay to --min-lr."""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, min_lr: float, warmup: int, decay_iters: int, style: str) -> float:
    """lr(step) for optimizer step `step` (0-based).

    warm-up: lr * step / warmup for step <= warmup, as Megatron (slime's scheduler): the first step runs at 0, the
    rate reaches lr at step `warmup`;
    then with progress x = (step - warmup) / (decay_iters - warmup) clipped to [0, 1]:
    constant: lr; linear: min_lr + (lr - min_lr)(1 - x); cosine: min_lr + (lr - min_lr)(1 + cos(pi x)) / 2.
    """
    if warmup > 0 and step <= warmup:
        return lr * step / warmup
    if style == "constant":
        return lr
    span = max(1, decay_iters - warmup)
    x = min(1.0, max(0.0, (step - warmup) / span))
    if style == "linear":
        return min_lr + (lr - min_lr) * (1.0 - x)
    if style == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * x))
    raise ValueError(f"unknown --lr-decay-style {style!r}")
