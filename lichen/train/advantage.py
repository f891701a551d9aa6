"""The advantages phase of a train step: every trainer-side advantage computation lives here.

From the step's samples and the log-probs / values of the no-grad passes (lichen.train.train_batch.TrainBatch):
- the per-token KL to the reference, for the estimators that fold it into rewards (--kl-coef);
- the estimator chosen by --advantage-estimator (group-normalized, RLOO, REINFORCE++, or GAE with the PPO critic),
  or the plug-in given by --custom-advantage-function-path;
- on-policy distillation: A_t -= opd_kl_coef * (log pi(y_t) - log pi_teacher(y_t)), the per-token reverse KL.
The math itself lives in `lichen.algo` (pure functions on tensors); this module gathers rewards, group ids and
validity from the Samples and picks the function.
"""

from __future__ import annotations

from typing import Any

import torch

from lichen import algo
from lichen.config.train_config import AdvantageConfig, LossConfig
from lichen.train.train_batch import TrainBatch
from lichen.types import Sample, Status

GROUP_ESTIMATORS = ("grpo", "gspo", "cispo")


def sample_rewards(samples: list[Sample], reward_key: str | None) -> torch.Tensor:
    return torch.tensor(
        [s.scalar_reward(reward_key) if s.status != Status.FAILED else 0.0 for s in samples], dtype=torch.float32
    )


def step_advantages(
    cfg: AdvantageConfig, loss: LossConfig, tb: TrainBatch, custom_fn=None, plugin_args: Any = None
) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """(advantages [n, R], GAE returns [n, R] or None, metrics) of the step.

    `loss` gives the KL estimator (--kl-loss-type) and --loss-type (SFT has no advantages). `custom_fn` is the
    loaded --custom-advantage-function-path plug-in; it receives the opaque `plugin_args`.
    """
    mask = tb.mask
    metrics: dict = {}
    kl = None
    if tb.ref_log_probs is not None and cfg.kl_coef != 0:
        base = tb.old_log_probs if tb.old_log_probs is not None else tb.policy_log_probs
        kl = algo.approx_kl(base, tb.ref_log_probs, loss.kl_loss_type) * mask
    returns = None
    if loss.loss_type == "sft_loss":
        adv = torch.zeros_like(mask)
    elif tb.values is not None:
        adv, returns = critic_advantages(cfg, tb.samples, tb.values, mask, kl)
        metrics["critic/values_mean"] = float((tb.values * mask).sum() / mask.sum().clamp(min=1))
    else:
        adv, adv_metrics = compute_advantages(cfg, tb.samples, mask, kl, custom_fn=custom_fn, plugin_args=plugin_args)
        metrics.update(adv_metrics)
    if tb.teacher_log_probs is not None:
        policy = (
            tb.old_log_probs
            if tb.old_log_probs is not None
            else (tb.rollout_log_probs if tb.rollout_log_probs is not None else tb.policy_log_probs)
        )
        reverse_kl = (policy - tb.teacher_log_probs) * mask
        adv = adv - cfg.opd_kl_coef * reverse_kl
        metrics["train/opd_reverse_kl"] = float(reverse_kl.sum() / mask.sum().clamp(min=1))
    return adv, returns, metrics


def critic_advantages(
    cfg: AdvantageConfig, samples: list[Sample], values: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """--advantage-estimator ppo: GAE over token rewards (-kl_coef * KL_t, plus the reward at the last token)
    with the critic's values; returns (advantages, returns)."""
    kl_tok = kl if kl is not None else torch.zeros_like(mask)
    token_rewards = algo.reinforce_plus_plus_token_rewards(
        sample_rewards(samples, cfg.reward_key).to(mask.device), kl_tok, mask, cfg.kl_coef
    )
    adv, returns = algo.gae_advantages(token_rewards, values, mask, cfg.gamma, cfg.lambd)
    if cfg.normalize_advantages:
        adv = algo.whiten(adv, mask)
    return adv, returns


def compute_advantages(
    cfg: AdvantageConfig,
    samples: list[Sample],
    resp_mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    *,
    custom_fn=None,
    plugin_args: Any = None,
) -> tuple[torch.Tensor, dict]:
    """Returns (advantages [B, R] on resp_mask's device, metrics) of the critic-free estimators.

    resp_mask [B, R] is the loss mask over response tokens; kl [B, R] (policy vs reference, per token) is only
    needed by the REINFORCE++ estimators with --kl-coef. `custom_fn(plugin_args, samples, rewards=, mask=, kl=)`
    replaces the estimator.
    """
    dev = resp_mask.device
    rewards = sample_rewards(samples, cfg.reward_key).to(dev)
    group_ids = torch.tensor([s.group_index for s in samples], dtype=torch.long, device=dev)
    valid = torch.tensor([s.status != Status.FAILED for s in samples], dtype=torch.bool, device=dev)
    if custom_fn is not None:
        adv = custom_fn(plugin_args, samples, rewards=rewards, mask=resp_mask, kl=kl)
        return adv * resp_mask, {}
    est = cfg.advantage_estimator
    normalize = not cfg.disable_rewards_normalization
    metrics: dict = {}
    if est in GROUP_ESTIMATORS:
        adv, small = algo.group_normalized_rewards(
            rewards, group_ids, valid, normalize=normalize, std_normalize=not cfg.disable_grpo_std_normalization
        )
        tok = algo.broadcast_to_tokens(adv, resp_mask)
    elif est == "rloo":
        adv, small = algo.rloo_advantages(rewards, group_ids, valid)
        tok = algo.broadcast_to_tokens(adv, resp_mask)
    elif est in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        kl_tok = kl if kl is not None else torch.zeros_like(resp_mask)
        small = 0
        if est == "reinforce_plus_plus_baseline":
            adv, small = algo.group_normalized_rewards(rewards, group_ids, valid, normalize=True, std_normalize=False)
            tok = algo.broadcast_to_tokens(adv, resp_mask) - cfg.kl_coef * kl_tok * resp_mask
        else:
            token_rewards = algo.reinforce_plus_plus_token_rewards(rewards, kl_tok, resp_mask, cfg.kl_coef)
            tok = algo.discounted_returns(token_rewards, resp_mask, cfg.gamma)
    else:
        raise ValueError(f"--advantage-estimator {est!r} is not available yet")
    if cfg.normalize_advantages:
        tok = algo.whiten(tok, resp_mask)
    metrics["train/groups_without_signal"] = small
    return tok * resp_mask, metrics
