"""Building lichen's rollout worker in tests the way the loop does: its RolloutConfig from the resolved flags,
the namespace handed along for plug-ins."""

from __future__ import annotations

from typing import Any

from lichen.config.rollout_config import RolloutConfig
from lichen.rollout.manager import RolloutManager


def rollout_worker(args: Any, engine: Any = None) -> RolloutManager:
    return RolloutManager(RolloutConfig.from_args(args), args, engine=engine)
