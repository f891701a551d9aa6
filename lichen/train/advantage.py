"""Per-token advantages for a training step, chosen by --advantage-estimator.

The estimator math lives in `lichen.algo`; this module only gathers rewards, group ids and validity from the
Samples and picks the function. A plug-in given by --custom-advantage-function-path replaces it.
"""

from __future__ import annotations

import torch

from lichen import algo
from lichen.types import Sample, Status

GROUP_ESTIMATORS = ("grpo", "gspo", "cispo")


def sample_rewards(samples: list[Sample], reward_key: str | None) -> torch.Tensor:
    return torch.tensor(
        [s.scalar_reward(reward_key) if s.status != Status.FAILED else 0.0 for s in samples], dtype=torch.float32
    )


def compute_advantages(
    args,
    samples: list[Sample],
    resp_mask: torch.Tensor,
    kl: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """Returns (advantages [B, R] on resp_mask's device, metrics).

    resp_mask [B, R] is the loss mask over response tokens; kl [B, R] (policy vs reference, per token) is only
    needed by the REINFORCE++ estimators with --kl-coef.
    """
    dev = resp_mask.device
    rewards = sample_rewards(samples, args.reward_key).to(dev)
    group_ids = torch.tensor([s.group_index for s in samples], dtype=torch.long, device=dev)
    valid = torch.tensor([s.status != Status.FAILED for s in samples], dtype=torch.bool, device=dev)
    if getattr(args, "custom_advantage_function_path", None):
        from lichen.plugins import load_function

        fn = load_function(args.custom_advantage_function_path, "--custom-advantage-function-path")
        adv = fn(args, samples, rewards=rewards, mask=resp_mask, kl=kl)
        return adv * resp_mask, {}
    est = args.advantage_estimator
    normalize = not args.disable_rewards_normalization
    metrics: dict = {}
    if est in GROUP_ESTIMATORS:
        adv, small = algo.group_normalized_rewards(
            rewards, group_ids, valid, normalize=normalize, std_normalize=not args.disable_grpo_std_normalization
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
            tok = algo.broadcast_to_tokens(adv, resp_mask) - args.kl_coef * kl_tok * resp_mask
        else:
            token_rewards = algo.reinforce_plus_plus_token_rewards(rewards, kl_tok, resp_mask, args.kl_coef)
            tok = algo.discounted_returns(token_rewards, resp_mask, args.gamma)
    else:
        raise ValueError(f"--advantage-estimator {est!r} is not available yet")
    if args.normalize_advantages:
        tok = algo.whiten(tok, resp_mask)
    metrics["train/groups_without_signal"] = small
    return tok * resp_mask, metrics
