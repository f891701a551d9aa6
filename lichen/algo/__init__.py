"""RL math as pure tensor functions: advantages, returns, KL estimators, losses, reducers.

Imports nothing of lichen above it (docs/architecture.md#import-directions), so every function here can be tested
and reused alone.
"""

from lichen.algo.advantages import (
    broadcast_to_tokens,
    discounted_returns,
    gae_advantages,
    group_normalized_rewards,
    reinforce_plus_plus_token_rewards,
    rloo_advantages,
    whiten,
)
from lichen.algo.kl import KL_TYPES, approx_kl
from lichen.algo.losses import (
    cispo_policy_loss,
    entropy_from_logits,
    gspo_policy_loss,
    opsm_mask,
    ppo_policy_loss,
    sft_loss,
    value_loss,
)
from lichen.algo.reduce import LOSS_AGGREGATION_MODES, aggregate_loss, masked_mean, masked_sum

__all__ = [
    "KL_TYPES",
    "LOSS_AGGREGATION_MODES",
    "aggregate_loss",
    "approx_kl",
    "broadcast_to_tokens",
    "cispo_policy_loss",
    "discounted_returns",
    "entropy_from_logits",
    "gae_advantages",
    "group_normalized_rewards",
    "gspo_policy_loss",
    "masked_mean",
    "masked_sum",
    "opsm_mask",
    "ppo_policy_loss",
    "reinforce_plus_plus_token_rewards",
    "rloo_advantages",
    "sft_loss",
    "value_loss",
    "whiten",
]
