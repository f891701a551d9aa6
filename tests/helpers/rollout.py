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


def dicts_without_engine(groups: list[list[Any]], engine_urls: list[str]) -> list[list[dict]]:
    """The groups' samples as dicts, minus the engine that served each (which of two servers a request reaches
    depends on load, not on the data); asserts each sample names one of `engine_urls`."""
    out = []
    for g in groups:
        rows = []
        for s in g:
            d = s.to_dict()
            served = d["metadata"].pop("engine")
            assert set(served if isinstance(served, list) else [served]) <= set(engine_urls), served
            rows.append(d)
        out.append(rows)
    return out
