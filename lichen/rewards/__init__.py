"""Rewards: the hub of built-in rm types (`--rm-type`), custom verifiers (`--custom-rm-path`, `--group-rm`), and
the runner that scores a batch concurrently with per-sample timeouts and failure isolation."""

from lichen.rewards.hub import BOXABLE, RULES, RewardHub, check_rm_type, get_rule_reward, grade, known_rm_types
from lichen.rewards.runner import (
    GroupReward,
    RewardFn,
    build_reward_fn,
    score_samples,
    score_samples_async,
)

__all__ = [
    "BOXABLE",
    "GroupReward",
    "RULES",
    "RewardFn",
    "RewardHub",
    "build_reward_fn",
    "check_rm_type",
    "get_rule_reward",
    "grade",
    "known_rm_types",
    "score_samples",
    "score_samples_async",
]
