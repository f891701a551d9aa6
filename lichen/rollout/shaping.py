"""Reward shaping applied after the verifier: DAPO's soft overlong penalty.

With L = --rollout-max-response-len, B = --overlong-buffer-len and F = --overlong-penalty-factor, a response of
l tokens gets

    penalty(l) = 0                                  if l <= L - B
    penalty(l) = -min(1, (l - (L - B)) / B) * F     otherwise

added to its reward: responses inside the last B tokens of the budget lose reward linearly, reaching -F at
l = L (a truncated response). For a dict reward the penalty is added to the value at --reward-key (default
"score"), the value the trainer reads. Failed samples (verifier error) keep their reward untouched.
"""

from __future__ import annotations

from typing import Iterable

from lichen.errors import ConfigError
from lichen.types import Sample, Status


def overlong_penalty(response_length: int, max_response_len: int, buffer_len: int, factor: float = 1.0) -> float:
    """penalty(l) = 0 if l <= L - B else -min(1, (l - (L - B)) / B) * F; see the module docstring."""
    if not 0 < buffer_len <= max_response_len:
        raise ValueError(f"buffer_len must be in (0, {max_response_len}], got {buffer_len}")
    expected = max_response_len - buffer_len
    if response_length <= expected:
        return 0.0
    return -min(1.0, (response_length - expected) / buffer_len) * factor


def add_to_reward(sample: Sample, delta: float, reward_key: str | None) -> None:
    """Add `delta` to the sample's scalar reward (a dict reward: to its value at `reward_key` or "score")."""
    reward = sample.reward
    if isinstance(reward, dict):
        key = reward_key or "score"
        if key not in reward:
            raise ConfigError(
                f"--overlong-buffer-len: the reward dict has no key {key!r} (keys: {', '.join(map(str, reward))}); "
                "set --reward-key to the key holding the scalar reward"
            )
        sample.reward = {**reward, key: float(reward[key]) + delta}
    else:
        sample.reward = (float(reward) if reward is not None else 0.0) + delta


def apply_overlong_penalty(
    samples: Iterable[Sample],
    *,
    max_response_len: int,
    buffer_len: int,
    factor: float,
    reward_key: str | None,
) -> None:
    """Add the overlong penalty to every non-failed sample's reward; the penalty goes to metadata["overlong_penalty"]."""
    for s in samples:
        if s.status == Status.FAILED:
            continue
        p = overlong_penalty(s.response_length, max_response_len, buffer_len, factor)
        if p != 0.0:
            add_to_reward(s, p, reward_key)
        if s.metadata is None:
            s.metadata = {}
        s.metadata["overlong_penalty"] = p


def overlong_metrics(samples: Iterable[Sample]) -> dict:
    """{"rollout/overlong_penalty_mean", "rollout/overlong_penalized_ratio"} over the samples that were shaped
    ({} when none was: the penalty is off, or every sample failed)."""
    penalties = [s.metadata["overlong_penalty"] for s in samples if s.metadata and "overlong_penalty" in s.metadata]
    if not penalties:
        return {}
    return {
        "rollout/overlong_penalty_mean": sum(penalties) / len(penalties),
        "rollout/overlong_penalized_ratio": sum(p != 0.0 for p in penalties) / len(penalties),
    }
