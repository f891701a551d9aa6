"""Resolve derived values and check every flag, group by group, before anything loads.

The order matters: the debug flags decide what is required (no reward or prompt data when replaying dumps),
placement is resolved before the weight-sync rules read `colocate`, the batch arithmetic needs the rollout
shape, LoRA reads the resolved estimator, runtime and --save, and eval defaults copy resolved rollout values.
"""

from __future__ import annotations

import argparse

from lichen.config import (
    algo,
    checkpoint,
    data,
    debug,
    eval,
    lora,
    model,
    observe,
    placement,
    rollout,
    sampling,
    sync,
    tools,
    train,
)

CHECK_ORDER = (
    model,
    debug,
    placement,
    data,
    rollout,
    tools,
    sampling,
    train,
    algo,
    sync,
    checkpoint,
    lora,
    eval,
    observe,
)


def resolve_and_validate(args: argparse.Namespace) -> argparse.Namespace:
    """Fill in derived values on `args` in place and raise ConfigError at the first rule broken."""
    if not hasattr(args, "_explicit"):
        args._explicit = set()
    if not hasattr(args, "sglang_passthrough"):
        args.sglang_passthrough = []
    for group in CHECK_ORDER:
        group.check(args)
    return args
