"""Checkpoint flags: where to save, where to resume from, how often, and the HF export.

`--load DIR` resumes from the newest intact checkpoint in DIR (every file verified against its checksums.json; a
damaged newest one falls back to an older intact one with a warning, none intact is exit code 2 — see
lichen.train.checkpoint and docs/checkpoints.md); a DIR that exists but holds no checkpoint starts the run fresh.
A DIR that does not exist is a mistake (a typo would silently restart training) unless it is the same directory
as `--save`, the usual "resume if there is something to resume" pattern.
"""

from __future__ import annotations

import argparse
import os

from lichen.config.checks import check_int_at_least, check_not_torch_dist
from lichen.errors import ConfigError


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpoints")
    g.add_argument("--save", metavar="DIR", default=None, help="save checkpoints here (default: no checkpoints)")
    g.add_argument(
        "--load",
        metavar="DIR",
        default=None,
        help="resume from the newest intact checkpoint in DIR (files verified against its checksums; a damaged one "
        "falls back to the previous intact one); an existing DIR without one starts fresh (default: start from "
        "--hf-checkpoint)",
    )
    g.add_argument(
        "--save-interval",
        type=int,
        default=None,
        help="save every N rollout steps (needs --save; default: only at the end of the run when --save is given)",
    )


def check(args: argparse.Namespace) -> None:
    if args.save_interval is not None and args.save is None:
        raise ConfigError("--save-interval needs --save DIR: where the checkpoints go")
    check_int_at_least(args, "save_interval", 1)
    for dest, flag in (("save", "--save"), ("load", "--load")):
        path = getattr(args, dest)
        if path is not None and os.path.exists(path) and not os.path.isdir(path):
            raise ConfigError(f"{flag} {path!r}: exists and is not a directory; give a directory")
    if args.load is not None:
        check_not_torch_dist(args.load, "--load")
    if args.load is not None and not os.path.isdir(args.load):
        same_as_save = args.save is not None and os.path.abspath(args.save) == os.path.abspath(args.load)
        if not same_as_save:
            raise ConfigError(
                f"--load {args.load!r}: no such directory; give an existing checkpoint directory, or the same "
                "directory as --save to resume only when a checkpoint is there"
            )
