"""Building lichen's rollout side in tests the way the loop does: configs from the flags, the namespace handed
along for plug-ins."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from lichen.config import build_train_parser
from lichen.config.engine_config import EngineConfig
from lichen.config.rollout_config import RewardConfig, RolloutConfig
from lichen.rollout.manager import RolloutManager


def rollout_worker(args: Any, engine: Any = None) -> RolloutManager:
    return RolloutManager(RolloutConfig.from_args(args), args, engine=engine, engine_cfg=EngineConfig.from_args(args))


def reward_config(**overrides: Any) -> RewardConfig:
    """lichen's RewardConfig with the flags' defaults, `overrides` (field names) applied."""
    defaults = build_train_parser().parse_args([])
    return replace(RewardConfig.from_args(defaults), **overrides)
