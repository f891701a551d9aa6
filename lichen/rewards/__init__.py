"""Rewards: rule rewards picked by `--rm-type`, custom verifiers from `--custom-rm-path`, and the runner that
scores a batch concurrently with per-sample timeouts and failure isolation."""

from lichen.rewards.rules import RULES, get_rule_reward
from lichen.rewards.runner import (
    RewardFn,
    RuleReward,
    build_reward_fn,
    score_samples,
    score_samples_async,
)

__all__ = [
    "RULES",
    "RewardFn",
    "RuleReward",
    "build_reward_fn",
    "get_rule_reward",
    "score_samples",
    "score_samples_async",
]
