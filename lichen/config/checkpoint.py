"""Checkpoint flags: where to save, where to resume from, how often, and the HF export.

`--load DIR` resumes from the newest intact checkpoint in DIR (every file verified against its checksums.json; a
damaged newest one falls back to an older intact one with a warning, none intact is exit code 2 — see
lichen.train.checkpoint and docs/checkpoints.md); a DIR that exists but holds no checkpoint starts the run fresh.
A DIR that does not exist is a mistake (a typo would silently restart training) unless it is the same directory
as `--save`, the usual "resume if there is something to resume" pattern.

slime's `--no-save-optim` leaves the optimizer state out of the checkpoints (a resume from one starts a fresh
optimizer, with a warning), and `--save-hf PATH` writes the policy as an HF checkpoint to
`PATH.format(rollout_id=N)` at every checkpoint save, beside the checkpoint's own hf/.
"""

from __future__ import annotations

import argparse
import os

from lichen.config.checks import check_int_at_least, check_not_torch_dist
from lichen.config.train_config import save_hf_dir
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
    g.add_argument(
        "--async-save",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write checkpoints off the training path: a save copies the trainer's state (weights, optimizer, "
        "RNG) to CPU memory and returns, a background thread writes the files, and checksums.json and `latest` "
        "follow once every file is written (a crash meanwhile leaves the previous checkpoint the one --load "
        "picks). Costs one copy of the model and optimizer state in CPU memory, kept and reused by later saves. "
        "The next save, the end of the run and any error wait for the write. --no-async-save writes before the "
        "step goes on (slime's flag; default: on)",
    )
    g.add_argument(
        "--no-save-optim",
        action="store_true",
        help="checkpoints without the optimizer state (Adam moments and step counts; the learning-rate schedule's "
        "position and the RNG states are still saved): smaller, but a resume from one starts a fresh optimizer, "
        "with a warning (slime's flag; default: off)",
    )
    g.add_argument(
        "--save-hf",
        metavar="PATH",
        default=None,
        help="at every checkpoint save, also write the policy as a Hugging Face checkpoint (safetensors, config, "
        "tokenizer; the same export as the checkpoint's hf/) to PATH.format(rollout_id=N), e.g. "
        "'hf_out/step_{rollout_id}' (a PATH without {rollout_id} is overwritten each time). Needs --save; "
        "under --runtime ray every trainer rank writes some of its files, so PATH must be on storage every rank's "
        "node shares, as --save (slime's flag; default: none)",
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
    _check_save_hf(args)
    if args.load is not None and not os.path.isdir(args.load):
        same_as_save = args.save is not None and os.path.abspath(args.save) == os.path.abspath(args.load)
        if not same_as_save:
            raise ConfigError(
                f"--load {args.load!r}: no such directory; give an existing checkpoint directory, or the same "
                "directory as --save to resume only when a checkpoint is there"
            )


def _check_save_hf(args: argparse.Namespace) -> None:
    """--save-hf: needs --save (it writes at checkpoint saves), a template that formats with rollout_id only, and
    never the --hf-checkpoint directory (the export would replace the run's base model)."""
    template = args.save_hf
    if template is None:
        return
    if args.save is None:
        raise ConfigError(
            f"--save-hf {template!r} writes an HF export at every checkpoint save, and no --save DIR is given; add "
            "--save DIR (and --save-interval N for more than the final save)"
        )
    try:
        first = save_hf_dir(template, 0)
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as e:
        raise ConfigError(
            f"--save-hf {template!r}: not a path template with {{rollout_id}} as its only field ({type(e).__name__}: "
            f"{e}); e.g. 'hf_out/step_{{rollout_id}}', or a plain path"
        ) from None
    if not first:
        raise ConfigError("--save-hf: empty path; give a directory (template) for the HF exports")
    hf = getattr(args, "hf_checkpoint", None)
    if hf and os.path.abspath(first) == os.path.abspath(hf):
        raise ConfigError(
            f"--save-hf {template!r} is the --hf-checkpoint directory: the export would replace the base model; "
            "give another directory"
        )
    if os.path.exists(first) and not os.path.isdir(first):
        raise ConfigError(f"--save-hf {template!r}: {first!r} exists and is not a directory; give a directory")
