"""Debug flags: run only one half of the loop, and dump or replay rollout data."""

from __future__ import annotations

import argparse
import os

from lichen.errors import ConfigError

ROLLOUT_ID_FIELD = "{rollout_id}"
# the forge rollout function by the paths a script may name it with (slime's own, aliased; lichen's)
FORGE_FUNCTION_PATHS = ("slime.rollout.forge_load.generate_rollout", "lichen.rollout.forge_load.generate_rollout")


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("debug")
    g.add_argument(
        "--debug-rollout-only",
        action="store_true",
        help="generate and score rollouts but never train (the trainer does nothing, engines keep their weights); "
        "turns --colocate and offload off",
    )
    g.add_argument(
        "--debug-train-only",
        action="store_true",
        help="train on rollout dumps replayed from --load-debug-rollout-data; no engine, no weight sync",
    )
    g.add_argument(
        "--save-debug-rollout-data",
        metavar="PATH_TEMPLATE",
        default=None,
        help="write each rollout batch to this path; must contain {rollout_id}, e.g. dumps/rollout_{rollout_id} "
        "(default: no dumps)",
    )
    g.add_argument(
        "--save-debug-train-data",
        metavar="PATH_TEMPLATE",
        default=None,
        help="write what the trainer used each step (rewards, advantages, old/ref/rollout log-probs, loss mask) to "
        "this path; must contain {rollout_id} (default: no dumps)",
    )
    g.add_argument(
        "--load-debug-rollout-data",
        metavar="PATH_TEMPLATE",
        default=None,
        help="replay rollout batches from this path template (must contain {rollout_id}); implies "
        "--debug-train-only (default: none)",
    )
    g.add_argument(
        "--load-forge-rollout-data",
        metavar="PATH",
        default=None,
        help="slime's forge replay: each rollout step trains on the samples dumped at PATH (one file for every "
        "step, or a {rollout_id} template that falls back to step 0's file) instead of generating, while engine "
        "servers, weight sync and offload run as usual (a memory test; default: none)",
    )


def check(args: argparse.Namespace) -> None:
    for dest, flag in (
        ("save_debug_rollout_data", "--save-debug-rollout-data"),
        ("save_debug_train_data", "--save-debug-train-data"),
        ("load_debug_rollout_data", "--load-debug-rollout-data"),
    ):
        template = getattr(args, dest)
        if template is not None and ROLLOUT_ID_FIELD not in template:
            raise ConfigError(
                f"{flag} {template!r}: the path template must contain {ROLLOUT_ID_FIELD} (one file per rollout "
                f"step), e.g. dumps/rollout_{ROLLOUT_ID_FIELD}"
            )
    if args.debug_rollout_only and args.load_debug_rollout_data is not None:
        raise ConfigError(
            "--debug-rollout-only and --load-debug-rollout-data exclude each other: replaying dumps means training "
            "only (it implies --debug-train-only); drop one of them"
        )
    _check_forge(args)
    if args.debug_rollout_only and args.debug_train_only:
        raise ConfigError(
            "--debug-rollout-only and --debug-train-only exclude each other (together nothing would run); drop one"
        )
    if args.load_debug_rollout_data is not None:
        args.debug_train_only = True
    elif args.debug_train_only:
        raise ConfigError(
            "--debug-train-only replays rollout dumps: add --load-debug-rollout-data PATH_TEMPLATE (files written "
            "by an earlier run with --save-debug-rollout-data)"
        )


def _check_forge(args: argparse.Namespace) -> None:
    """--load-forge-rollout-data replaces the rollout function and keeps engines and training: it excludes the
    flags that drop either or that name another rollout function."""
    if args.load_forge_rollout_data is None:
        return
    for dest, flag in (
        ("load_debug_rollout_data", "--load-debug-rollout-data"),
        ("debug_rollout_only", "--debug-rollout-only"),
        ("debug_train_only", "--debug-train-only"),
    ):
        if getattr(args, dest):
            raise ConfigError(
                f"--load-forge-rollout-data and {flag} exclude each other: the forge replay trains with engines and "
                "weight sync live (--load-debug-rollout-data replays without engines); drop one of them"
            )
    path = getattr(args, "rollout_function_path", None)
    if path and path not in FORGE_FUNCTION_PATHS:
        raise ConfigError(
            f"--load-forge-rollout-data replaces the rollout function, but --rollout-function-path {path!r} names "
            "another; drop --rollout-function-path"
        )
    if ROLLOUT_ID_FIELD not in args.load_forge_rollout_data and not os.path.isfile(args.load_forge_rollout_data):
        raise ConfigError(
            f"--load-forge-rollout-data {args.load_forge_rollout_data!r}: no such file (give a dump written by "
            f"--save-debug-rollout-data, or a template with {ROLLOUT_ID_FIELD})"
        )
