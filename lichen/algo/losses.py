"""Per-token policy, value and SFT losses (reduce them with `lichen.algo.reduce.aggregate_loss`).

Layout: per-token tensors are right-padded `[B, T]` over response tokens with a float mask `[B, T]`
(1 = trained on, 0 = padding / masked out). Losses are returned per token, unreduced; the policy losses return a
dict {"loss", "clipfrac", "ppo_kl", "ratio"} where only "loss" carries gradient (the rest are detached metrics).

Importance ratios are exp of a log-ratio clamped to [-20, 20]: beyond that the ratio is far outside any clip
range, and an inf in the forward pass would turn zero gradients into NaN in the backward pass.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lichen.algo.reduce import masked_mean

_LOG_RATIO_CLAMP = 20.0


def _clip_bounds(eps_clip: float, eps_clip_high: float | None) -> tuple[float, float]:
    high = eps_clip if eps_clip_high is None else eps_clip_high
    if eps_clip < 0 or high < 0:
        raise ValueError(f"--eps-clip and --eps-clip-high must be >= 0, got {eps_clip} and {high}")
    return 1.0 - eps_clip, 1.0 + high


def _clipped_surrogate(
    ratio: Tensor,
    advantages: Tensor,
    low: float,
    high: float,
    eps_clip_c: float | None,
) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic surrogate: loss = max(-A*ratio, -A*clip(ratio, low, high)); dual clip for A < 0:
    loss = min(loss, -c*A). Returns (loss, clipfrac) with clipfrac = 1.0 where the clipped branch won."""
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(low, high)
    loss = torch.maximum(pg1, pg2)
    clipfrac = (pg2 > pg1).to(ratio.dtype).detach()
    if eps_clip_c is not None:
        if not eps_clip_c > 1.0:
            raise ValueError(f"dual-clip constant --eps-clip-c must be > 1, got {eps_clip_c}")
        dual = -eps_clip_c * advantages
        loss = torch.where(advantages < 0, torch.minimum(loss, dual), loss)
    return loss, clipfrac


def ppo_policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> dict[str, Tensor]:
    """PPO clipped policy loss, per token.

        ratio = exp(log_probs - old_log_probs)
        loss  = max(-A * ratio, -A * clip(ratio, 1 - eps_clip, 1 + eps_clip_high))
        dual clip (eps_clip_c = c > 1): where A < 0, loss = min(loss, -c * A)
    Also returns clipfrac (1.0 where the clipped term was larger), ppo_kl = old_log_probs - log_probs, ratio.
    """
    low, high = _clip_bounds(eps_clip, eps_clip_high)
    log_ratio = log_probs - old_log_probs
    ratio = torch.exp(log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    loss, clipfrac = _clipped_surrogate(ratio, advantages, low, high, eps_clip_c)
    return {"loss": loss, "clipfrac": clipfrac, "ppo_kl": (-log_ratio).detach(), "ratio": ratio.detach()}


def gspo_policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
) -> dict[str, Tensor]:
    """GSPO: PPO clipping on a sequence-level ratio, with the gradient applied per token.

        s_b      = mean over the sample's masked tokens of (log_probs - old_log_probs)    (0 if none)
        ratio_bt = exp(sg(s_b) + log_probs_bt - sg(log_probs_bt))   (value exp(s_b); d/d log_probs_bt = ratio_bt)
        loss     = max(-A * ratio, -A * clip(ratio, 1 - eps_clip, 1 + eps_clip_high))
    ppo_kl is per token (old_log_probs - log_probs), as in the other losses.
    """
    low, high = _clip_bounds(eps_clip, eps_clip_high)
    log_ratio = log_probs - old_log_probs
    seq_log_ratio = masked_mean(log_ratio.detach(), mask, dim=-1).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(seq_log_ratio[:, None] + log_probs - log_probs.detach())
    loss, clipfrac = _clipped_surrogate(ratio, advantages, low, high, None)
    return {"loss": loss, "clipfrac": clipfrac, "ppo_kl": (-log_ratio).detach(), "ratio": ratio.detach()}


def cispo_policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
) -> dict[str, Tensor]:
    """CISPO: a REINFORCE loss weighted by a clipped, stop-gradient importance ratio; no token loses its gradient.

        loss = -sg(clip(ratio, 1 - eps_clip, 1 + eps_clip_high)) * A * log_probs
    clipfrac is 1.0 where the ratio was outside the clip range.
    """
    low, high = _clip_bounds(eps_clip, eps_clip_high)
    log_ratio = (log_probs - old_log_probs).detach()
    ratio = torch.exp(log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    weight = ratio.clamp(low, high)
    loss = -weight * advantages * log_probs
    clipfrac = ((ratio < low) | (ratio > high)).to(ratio.dtype)
    return {"loss": loss, "clipfrac": clipfrac, "ppo_kl": -log_ratio, "ratio": ratio}


def opsm_mask(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages_seq: Tensor,
    mask: Tensor,
    delta: float,
) -> Tensor:
    """Off-policy sequence masking: 0 for every token of a sample with A_b < 0 and
    mean over its masked tokens of (old_log_probs - log_probs) > delta; 1 elsewhere (padding included).
    Multiply it into the loss mask. No gradient."""
    with torch.no_grad():
        seq_kl = masked_mean(old_log_probs - log_probs, mask, dim=-1)
        drop = (advantages_seq < 0) & (seq_kl > delta)
        keep = (~drop).to(log_probs.dtype if log_probs.is_floating_point() else torch.float32)
        return keep[:, None].expand(mask.shape).clone()


def entropy_from_logits(logits: Tensor) -> Tensor:
    """H = -sum_v p_v log p_v over the last dim, with log p = logits - logsumexp(logits).

    Computed in at least float32; -inf logits (banned tokens) contribute 0 and give finite gradients.
    """
    x = logits if logits.dtype == torch.float64 else logits.float()
    # -inf would make p * log p = 0 * -inf = NaN (and NaN gradients); the most negative finite value gives p = 0.
    x = x.clamp(min=torch.finfo(x.dtype).min)
    log_p = x - torch.logsumexp(x, dim=-1, keepdim=True)
    return -(log_p.exp() * log_p).sum(dim=-1)


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor | None = None,
    *,
    value_clip: float | None = None,
) -> Tensor:
    """Per-token value loss.

        unclipped: (v - R)^2
        clipped:   max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2)    (value_clip = c)
    with no 0.5 factor, as slime's value loss (scale the critic's step with --critic-lr if you want one).
    Zero at masked positions when `mask` is given.
    """
    loss = (values - returns).square()
    if value_clip is not None:
        if value_clip < 0:
            raise ValueError(f"value clip must be >= 0, got {value_clip}")
        clipped = torch.maximum(torch.minimum(values, old_values + value_clip), old_values - value_clip)
        loss = torch.maximum(loss, (clipped - returns).square())
    if mask is not None:
        loss = torch.where(mask != 0, loss * mask, torch.zeros_like(loss))
    return loss


def sft_loss(log_probs: Tensor) -> Tensor:
    """Per-token negative log-likelihood: -log_probs."""
    return -log_probs
