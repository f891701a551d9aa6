"""Placement flags: colocated training and rollout, and which side releases its memory between phases.

Resolution (after the debug flags):
- `--debug-rollout-only` forces colocate and both offloads off (there is no training phase to make room for);
- otherwise each of offload_train / offload_rollout is its explicit --x / --no-x value when given, else on when
  `--offload` or `--colocate` is given, else off.
"""

from __future__ import annotations

import argparse


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("placement and offload")
    g.add_argument(
        "--colocate",
        action="store_true",
        help="trainer and engines share the same devices, taking turns; turns on --offload-train and "
        "--offload-rollout unless they are given explicitly",
    )
    g.add_argument(
        "--offload",
        action="store_true",
        help="shorthand for --offload-train --offload-rollout",
    )
    g.add_argument(
        "--offload-train",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the trainer releases its device memory while engines generate (default: on with --colocate or "
        "--offload, else off)",
    )
    g.add_argument(
        "--offload-rollout",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="engines release weights and KV cache while the trainer trains (default: on with --colocate or "
        "--offload, else off)",
    )


def check(args: argparse.Namespace) -> None:
    if args.debug_rollout_only:
        args.colocate = False
        args.offload_train = False
        args.offload_rollout = False
        return
    implied = bool(args.offload or args.colocate)
    if args.offload_train is None:
        args.offload_train = implied
    if args.offload_rollout is None:
        args.offload_rollout = implied
