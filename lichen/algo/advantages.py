"""Advantages and returns: group baselines (GRPO, RLOO), discounted returns, GAE, REINFORCE++ token rewards.

Layout: sample-level tensors are `[B]`; per-token tensors are right-padded `[B, T]` over response tokens with a
float mask `[B, T]` (1 = response token trained on, 0 = padding / masked out).

Masked positions in the token scans (`discounted_returns`, `gae_advantages`) are *not time steps*: their reward
is ignored, they apply no discount, and the running sum passes through them unchanged; outputs there are 0.
For right padding this is exactly "the episode ends at the last valid token"; for holes inside a response (e.g.
tool output in a multi-turn trajectory) the policy's own tokens on either side are adjacent steps.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Token scans work on chunks of this many positions: inside a chunk a [L, L] matrix of discount powers does the
# scan as one weighted sum; a Python loop carries the running sum across chunks (T / 64 iterations, not T).
_SCAN_CHUNK = 64


def _scan_dtype(x: Tensor) -> torch.dtype:
    """Accumulate in at least float32 (bf16/fp16 sums over thousands of tokens lose too much)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _group_stats(rewards: Tensor, group_ids: Tensor, valid: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """Per-group valid count n_g and reward sum S_g (float64), each sample's group index, validity, #groups."""
    if not (rewards.dim() == group_ids.dim() == valid.dim() == 1) or not (
        rewards.shape == group_ids.shape == valid.shape
    ):
        raise ValueError(
            f"rewards, group_ids and valid must all be [B]; got {tuple(rewards.shape)}, "
            f"{tuple(group_ids.shape)}, {tuple(valid.shape)}"
        )
    # Group ids may be arbitrary (e.g. global prompt indices); map them to 0..G-1.
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = uniq.numel()
    valid_f = valid.to(torch.float64)
    # Failed samples may carry NaN rewards; they must not leak into the sums.
    zero = torch.zeros((), dtype=torch.float64, device=rewards.device)
    r = torch.where(valid.bool(), rewards.to(torch.float64), zero)
    count = torch.zeros(num_groups, dtype=torch.float64, device=rewards.device).index_add_(0, inverse, valid_f)
    total = torch.zeros(num_groups, dtype=torch.float64, device=rewards.device).index_add_(0, inverse, r)
    return count, total, inverse, r, num_groups


def _out_dtype(rewards: Tensor) -> torch.dtype:
    return rewards.dtype if rewards.is_floating_point() else torch.float32


def group_normalized_rewards(
    rewards: Tensor,
    group_ids: Tensor,
    valid: Tensor,
    *,
    normalize: bool = True,
    std_normalize: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, int]:
    """GRPO advantages: each reward normalized within its prompt group, over the group's valid samples only.

    For group g with valid samples V_g (n_g = |V_g|):
        mean_g = sum_{j in V_g} r_j / n_g,   std_g = sqrt( sum_{j in V_g} (r_j - mean_g)^2 / (n_g - 1) )  (unbiased)
        A_i = (r_i - mean_g) / (std_g + eps)   if std_normalize
        A_i =  r_i - mean_g                    if normalize and not std_normalize
        A_i =  r_i                             if not normalize
    Invalid (failed) samples get A_i = 0. When normalizing, a group with n_g < 2 has no baseline and gets A = 0.

    Returns (advantages [B], number of groups with fewer than 2 valid samples). The count is reported for every
    setting of `normalize`, so the trainer can log how many groups carried no learning signal.
    """
    count, total, inverse, r, _ = _group_stats(rewards, group_ids, valid)
    valid_b = valid.bool()
    num_small = int((count < 2).sum().item())
    out_dtype = _out_dtype(rewards)
    if not normalize:
        return r.to(out_dtype), num_small
    mean = total / count.clamp(min=1)
    centered = torch.where(valid_b, r - mean[inverse], torch.zeros_like(r))
    if std_normalize:
        sq = torch.zeros_like(count).index_add_(0, inverse, centered.square())
        std = torch.sqrt(sq / (count - 1).clamp(min=1))
        centered = centered / (std[inverse] + eps)
    big_enough = (count >= 2)[inverse]
    adv = torch.where(big_enough & valid_b, centered, torch.zeros_like(centered))
    return adv.to(out_dtype), num_small


def rloo_advantages(rewards: Tensor, group_ids: Tensor, valid: Tensor) -> tuple[Tensor, int]:
    """REINFORCE leave-one-out: A_i = r_i - mean_{j in V_g, j != i} r_j = (n_g * r_i - S_g) / (n_g - 1).

    Invalid samples get 0; groups with fewer than 2 valid samples get 0 and are counted (second return value).
    """
    count, total, inverse, r, _ = _group_stats(rewards, group_ids, valid)
    n = count[inverse]
    adv = (n * r - total[inverse]) / (n - 1).clamp(min=1)
    keep = valid.bool() & (n >= 2)
    adv = torch.where(keep, adv, torch.zeros_like(adv))
    return adv.to(_out_dtype(rewards)), int((count < 2).sum().item())


def broadcast_to_tokens(adv: Tensor, mask: Tensor) -> Tensor:
    """Sample-level advantages [B] -> per-token [B, T]: adv[:, None] * mask."""
    return adv[:, None] * mask


def _masked_reverse_scan(x: Tensor, mask: Tensor, discount: float) -> Tensor:
    """y_t = m_t * (x_t + discount * y_{t'}) + (1 - m_t) * y_{t+1}, y_T = 0, where t' = t + 1.

    I.e. a reverse discounted cumulative sum over the masked positions only (masked positions neither add nor
    discount). Computed in chunks of L positions: with C(t) = number of valid positions in [chunk start, t),
        y_t = sum_{s >= t in chunk} discount^(C(s) - C(t)) * m_s * x_s  +  discount^(C(end) - C(t)) * y_next_chunk
    Returns y in the scan dtype, zero at masked positions.
    """
    if x.shape != mask.shape or x.dim() != 2:
        raise ValueError(f"expected [B, T] tensors of the same shape, got {tuple(x.shape)} and {tuple(mask.shape)}")
    dtype = _scan_dtype(x)
    batch, length = x.shape
    valid = mask != 0
    m = valid.to(dtype)
    b = torch.where(valid, x.to(dtype), torch.zeros((), dtype=dtype, device=x.device))
    if length == 0:
        return b
    chunk = _SCAN_CHUNK
    pad = (-length) % chunk
    if pad:
        m = torch.nn.functional.pad(m, (0, pad))
        b = torch.nn.functional.pad(b, (0, pad))
    num_chunks = m.shape[1] // chunk
    m = m.view(batch, num_chunks, chunk)
    b = b.view(batch, num_chunks, chunk)
    before = torch.cumsum(m, dim=-1) - m  # C(t): valid positions before t within its chunk
    in_chunk = m.sum(dim=-1, keepdim=True)  # C(end)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).triu()  # [t, s]: s >= t
    disc = torch.tensor(discount, dtype=dtype, device=x.device)
    out = torch.empty_like(b)
    carry = torch.zeros(batch, dtype=dtype, device=x.device)
    for c in range(num_chunks - 1, -1, -1):
        cb = before[:, c]  # [B, L]
        exponent = (cb[:, None, :] - cb[:, :, None]).clamp(min=0)  # [B, t, s] = C(s) - C(t)
        weights = torch.where(upper, disc**exponent, torch.zeros((), dtype=dtype, device=x.device))
        # Multiply-and-sum rather than bmm: a matmul may run in TF32/bf16 when the trainer allows it for speed.
        y = (weights * b[:, c, None, :]).sum(dim=-1)
        y = y + disc ** (in_chunk[:, c] - cb) * carry[:, None]
        out[:, c] = y
        carry = y[:, 0]
    out = out.view(batch, -1)[:, :length]
    return out * valid.to(dtype)


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_{t+1} over the masked positions (G after the last valid token = 0); 0 elsewhere."""
    return _masked_reverse_scan(rewards, mask, gamma).to(_out_dtype(rewards))


def _next_valid_values(values: Tensor, mask: Tensor) -> Tensor:
    """V at the next valid position after t (0 when there is none), per row; vectorized with a reverse cummin."""
    batch, length = values.shape
    valid = mask != 0
    pos = torch.arange(length, device=values.device).expand(batch, length)
    idx = torch.where(valid, pos, torch.full_like(pos, length))
    after = torch.cat([idx[:, 1:], torch.full_like(idx[:, :1], length)], dim=1)  # candidates s > t
    next_idx = torch.flip(torch.cummin(torch.flip(after, [1]), dim=1).values, [1])
    padded = torch.cat([values, torch.zeros_like(values[:, :1])], dim=1)  # column `length` = V beyond the end
    return padded.gather(1, next_idx)


def gae_advantages(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lambd: float) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation over the masked positions.

        delta_t = r_t + gamma * V_{t+1} - V_t      (V_{t+1}: value at the next valid position; 0 after the last)
        A_t     = delta_t + gamma * lambd * A_{t+1}
        R_t     = A_t + V_t
    Returns (advantages, returns), both [B, T] and 0 at masked positions.
    """
    if not (rewards.shape == values.shape == mask.shape) or rewards.dim() != 2:
        raise ValueError(
            f"rewards, values and mask must be [B, T] of one shape, got {tuple(rewards.shape)}, "
            f"{tuple(values.shape)}, {tuple(mask.shape)}"
        )
    dtype = _scan_dtype(values)
    valid = mask != 0
    zero = torch.zeros((), dtype=dtype, device=values.device)
    v = torch.where(valid, values.to(dtype), zero)
    r = torch.where(valid, rewards.to(dtype), zero)
    delta = r + gamma * _next_valid_values(v, mask) - v
    adv = _masked_reverse_scan(delta, mask, gamma * lambd)
    returns = torch.where(valid, adv + v, zero)
    out_dtype = _out_dtype(values)
    return adv.to(out_dtype), returns.to(out_dtype)


def reinforce_plus_plus_token_rewards(scalar_rewards: Tensor, kl: Tensor, mask: Tensor, kl_coef: float) -> Tensor:
    """REINFORCE++ token rewards: r_t = -kl_coef * kl_t on masked positions, plus the sample's scalar reward at
    its last valid response token. A sample with no valid token gets all zeros (its reward has nowhere to go).
    """
    if kl.shape != mask.shape or kl.dim() != 2 or scalar_rewards.shape != kl.shape[:1]:
        raise ValueError(
            f"expected scalar_rewards [B] and kl, mask [B, T]; got {tuple(scalar_rewards.shape)}, "
            f"{tuple(kl.shape)}, {tuple(mask.shape)}"
        )
    valid = mask != 0
    dtype = _scan_dtype(kl)
    token = torch.where(valid, -kl_coef * kl.to(dtype), torch.zeros((), dtype=dtype, device=kl.device))
    pos = torch.arange(kl.shape[1], device=kl.device).expand_as(kl)
    last = torch.where(valid, pos, torch.full_like(pos, -1)).max(dim=1).values  # -1: no valid token
    has_token = last >= 0
    bonus = torch.where(has_token, scalar_rewards.to(dtype), torch.zeros((), dtype=dtype, device=kl.device))
    token = token.scatter_add(1, last.clamp(min=0)[:, None], bonus[:, None])
    return token.to(_out_dtype(kl))


def whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """Masked whitening: (x - mu) / sqrt(var + eps) over the masked entries only; 0 on unmasked entries.

    mu is their mean and var their sample variance sum m (x - mu)^2 / (sum m - 1), as slime's
    distributed_masked_whiten (Bessel-corrected from two entries on; one entry has variance 0).
    """
    if values.shape != mask.shape:
        raise ValueError(f"values and mask must have one shape, got {tuple(values.shape)} and {tuple(mask.shape)}")
    dtype = _scan_dtype(values)
    valid = mask != 0
    zero = torch.zeros((), dtype=dtype, device=values.device)
    x = torch.where(valid, values.to(dtype), zero)
    n = valid.sum().to(dtype).clamp(min=1)
    mean = x.sum() / n
    centered = torch.where(valid, x - mean, zero)
    var = centered.square().sum() / (n - 1).clamp(min=1)
    return (centered * torch.rsqrt(var + eps)).to(_out_dtype(values))
