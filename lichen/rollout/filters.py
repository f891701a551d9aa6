"""Group filters for DAPO dynamic sampling, and the bookkeeping of the groups they keep.

Plug-in contract (`--dynamic-sampling-filter-path module.function`):

    fn(args, group: list[Sample]) -> bool      # True: keep this prompt group for training

The group holds the prompt's --n-samples-per-prompt scored samples (rewards already include the overlong
penalty when it is on; failed samples are in the group with status FAILED). It must return a bool (a numpy
bool too); anything else is a user error naming the flag.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from lichen.errors import UserError
from lichen.plugins import load_function
from lichen.types import Sample, Status

FILTER_FLAG = "--dynamic-sampling-filter-path"

GroupFilter = Callable[[Any, list[Sample]], bool]


def check_reward_nonzero_std(args, group: list[Sample]) -> bool:
    """Keep a group iff its valid (non-failed) samples' rewards are not all equal: std(r) > 0.

    A group whose rewards are all equal gets zero GRPO advantage for every sample, so it carries no policy-gradient
    signal (DAPO's dynamic sampling drops it). A group with fewer than 2 valid samples has no std and is dropped.
    """
    rewards = [s.scalar_reward(args.reward_key) for s in group if s.status != Status.FAILED]
    return len(rewards) >= 2 and max(rewards) > min(rewards)


def load_group_filter(path: str) -> GroupFilter:
    return load_function(path, FILTER_FLAG)


def run_group_filter(fn: GroupFilter, args, groups: list[list[Sample]], path: str = "") -> list[bool]:
    """fn(args, group) for every group, checked to be a bool."""
    keep = []
    for group in groups:
        result = fn(args, group)
        if not isinstance(result, (bool, np.bool_)):
            raise UserError(
                f"{FILTER_FLAG} {path or getattr(fn, '__name__', fn)!r} returned {type(result).__name__}; a group "
                "filter must return True (keep the group) or False (drop it)"
            )
        keep.append(bool(result))
    return keep


def trainable_group_count(k: int, n_samples_per_prompt: int, num_steps_per_rollout: int) -> int:
    """The largest k' <= k with k' * n_samples_per_prompt divisible by num_steps_per_rollout.

    The trainer splits a step's samples into num_steps_per_rollout equal global batches, so a batch with fewer
    groups than --rollout-batch-size must still split evenly: k' is a multiple of
    u = num_steps_per_rollout / gcd(num_steps_per_rollout, n_samples_per_prompt).
    """
    unit = num_steps_per_rollout // math.gcd(num_steps_per_rollout, n_samples_per_prompt)
    return (k // unit) * unit


def min_trainable_groups(n_samples_per_prompt: int, num_steps_per_rollout: int) -> int:
    """The smallest non-zero group count the trainer can split evenly (the unit u of trainable_group_count)."""
    return num_steps_per_rollout // math.gcd(num_steps_per_rollout, n_samples_per_prompt)


def renumber_groups(groups: list[list[Sample]]) -> list[list[Sample]]:
    """Set group_index = position in `groups` (the trainer's GRPO group id) and index = group_index * n + j."""
    for gi, group in enumerate(groups):
        n = len(group)
        for j, s in enumerate(group):
            s.group_index = gi
            s.index = gi * n + j
    return groups
