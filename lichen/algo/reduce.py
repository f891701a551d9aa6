"""Reducing per-token losses to the scalar the optimizer sees.

Layout: per-token tensors are right-padded `[B, T]` over response tokens with a float mask `[B, T]`
(1 = trained on, 0 = padding / masked out).

The trainer cuts one global batch into micro-batches, calls `aggregate_loss` on each, SUMS the results and
back-propagates per micro-batch. Every mode is therefore written as *the micro-batch's share of the global-batch
loss*: its normalizers are global counts passed in by the caller, never counts of the micro-batch itself, so
the summed loss (and its gradient) is the same however the global batch is cut.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOSS_AGGREGATION_MODES = (
    "seq-mean-token-mean",
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def _masked(values: Tensor, mask: Tensor) -> Tensor:
    """values * mask, with masked-out entries exactly 0 even where `values` is inf/NaN there (padding garbage)."""
    return torch.where(mask != 0, values * mask, torch.zeros((), dtype=values.dtype, device=values.device))


def masked_sum(values: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """sum(values * mask) over `dim` (all dims when None); masked-out entries never propagate NaN/inf."""
    masked = _masked(values, mask)
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """sum(values * mask) / sum(mask) over `dim` (all dims when None); 0 where sum(mask) == 0 (no NaN)."""
    mask = mask.to(values.dtype) if values.is_floating_point() else mask
    num = masked_sum(values, mask, dim)
    den = mask.sum() if dim is None else mask.sum(dim=dim)
    den = den.to(num.dtype)
    # Dividing by a safe denominator and selecting afterwards keeps the gradient finite for empty rows.
    safe = torch.where(den != 0, den, torch.ones_like(den))
    return torch.where(den != 0, num / safe, torch.zeros_like(num))


def aggregate_loss(
    per_token: Tensor,
    mask: Tensor,
    mode: str,
    *,
    global_num_samples: int,
    global_num_tokens: int,
    max_response_len: int | None = None,
) -> Tensor:
    """This micro-batch's share of the global-batch loss (a scalar); summing over micro-batches gives the loss.

    With x = per_token, m = mask, N = global_num_samples, K = global_num_tokens, L = max_response_len:

    - ``seq-mean-token-mean``:     sum_b [ sum_t x*m / sum_t m ] / N   (a sample with sum_t m = 0 adds 0)
    - ``token-mean``:              sum_{b,t} x*m / K
    - ``seq-mean-token-sum``:      sum_{b,t} x*m / N
    - ``seq-mean-token-sum-norm``: sum_{b,t} x*m / L / N

    N and K are counts over the whole global batch (all micro-batches, all data-parallel ranks the caller
    chooses to include); a zero count (everything masked) gives a loss of 0, not NaN.
    """
    if per_token.shape != mask.shape or per_token.dim() != 2:
        raise ValueError(
            f"aggregate_loss expects per_token and mask of the same [B, T] shape, got "
            f"{tuple(per_token.shape)} and {tuple(mask.shape)}"
        )
    if global_num_samples < 0 or global_num_tokens < 0:
        raise ValueError(
            f"global_num_samples and global_num_tokens must be >= 0, got {global_num_samples}, {global_num_tokens}"
        )
    mask = mask.to(per_token.dtype)
    num_samples = max(int(global_num_samples), 1)
    num_tokens = max(int(global_num_tokens), 1)
    if mode == "seq-mean-token-mean":
        return masked_mean(per_token, mask, dim=-1).sum() / num_samples
    if mode == "token-mean":
        return masked_sum(per_token, mask) / num_tokens
    if mode == "seq-mean-token-sum":
        return masked_sum(per_token, mask) / num_samples
    if mode == "seq-mean-token-sum-norm":
        if max_response_len is None or max_response_len <= 0:
            raise ValueError(
                "loss aggregation mode 'seq-mean-token-sum-norm' needs max_response_len > 0 "
                f"(set --rollout-max-response-len); got {max_response_len}"
            )
        return masked_sum(per_token, mask) / float(max_response_len) / num_samples
    raise ValueError(f"unknown loss aggregation mode {mode!r}; choose one of {', '.join(LOSS_AGGREGATION_MODES)}")
