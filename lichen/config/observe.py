"""Observability flags: TensorBoard, Weights & Biases, progress bars. Metrics always go to a JSONL file too."""

from __future__ import annotations

import argparse

from lichen.errors import ConfigError


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logging")
    g.add_argument(
        "--use-tensorboard",
        action="store_true",
        help="also write metrics as TensorBoard events under --output-dir (default: off)",
    )
    g.add_argument("--use-wandb", action="store_true", help="also log metrics to Weights & Biases (default: off)")
    g.add_argument(
        "--wandb-mode",
        choices=["online", "offline", "disabled"],
        default="online",
        help="W&B mode; offline writes locally for a later `wandb sync`",
    )
    g.add_argument("--wandb-project", metavar="NAME", default="lichen", help="W&B project")
    g.add_argument("--wandb-run-name", metavar="NAME", default=None, help="W&B run name (default: chosen by W&B)")
    g.add_argument(
        "--wandb-key",
        metavar="KEY",
        default=None,
        help="W&B API key (default: W&B's own login or the WANDB_API_KEY environment variable, which is preferable: "
        "a flag is visible to every local user in `ps`); redacted from every output of lichen",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bars (default: off, bars are shown)")


def check(args: argparse.Namespace) -> None:
    if not args.wandb_project:
        raise ConfigError("--wandb-project: must not be empty")
