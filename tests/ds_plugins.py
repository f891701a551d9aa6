"""Plug-ins for the dynamic-sampling and overlong-penalty tests (rewards and group filters by dotted path)."""

import numpy as np

# --custom-rm-path plug-ins: fn(args, sample) -> float | dict


def varies_every_fourth(args, sample) -> float:
    """Rewards differ within the group only for prompts whose data index is a multiple of 4 (reward = j)."""
    if sample.metadata["prompt_index"] % 4 == 0:
        return float(sample.index % args.n_samples_per_prompt)
    return 0.5


def constant_one(args, sample) -> float:
    return 1.0


def fail_odd(args, sample) -> float:
    if sample.index % 2:
        raise RuntimeError("verifier broke")
    return 1.0


def dict_reward(args, sample) -> dict:
    return {"score": 1.0, "acc": 0.5}


# --dynamic-sampling-filter-path plug-ins: fn(args, group: list[Sample]) -> bool

CALLS: list = []


def contract_probe(args, group) -> bool:
    """Records what the filter receives; keeps every group."""
    CALLS.append((args, group))
    return True


def reject_all(args, group) -> bool:
    return False


def keep_multiple_of_3(args, group) -> bool:
    return group[0].metadata["prompt_index"] % 3 == 0


def keep_numpy_bool(args, group):
    return np.bool_(True)


def returns_none(args, group):
    return None
