"""Forward-pass accounting shared by the benchmark child processes (run_lichen, run_trl)."""

from __future__ import annotations

from typing import Any


def positions(input_ids: Any) -> int:
    """Token positions a forward over `input_ids` runs: rows x sequence length (padding included)."""
    if input_ids is None:
        return 0
    return int(input_ids.shape[0]) * int(input_ids.shape[1]) if input_ids.dim() == 2 else int(input_ids.numel())


def record_forward(rec: dict, phase: str, n: int) -> None:
    """Add one forward of `n` positions to a step record: engine, trainer-with-grad or trainer-no-grad."""
    import torch

    if phase == "engine":
        rec["engine_tokens"] += n
        rec["engine_forwards"] += 1
    elif torch.is_grad_enabled():
        rec["train_grad_tokens"] += n
    else:
        rec["train_nograd_tokens"] += n
