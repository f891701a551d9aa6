"""Observability flags: TensorBoard, Weights & Biases, progress bars, the sample log, the trace and the hang
watchdog. Metrics always go to a JSONL file too; `lichen report RUN_DIR` turns a run directory into a web page."""

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
    g.add_argument("--wandb-group", metavar="NAME", default=None, help="W&B run group (default: none)")
    g.add_argument(
        "--wandb-key",
        metavar="KEY",
        default=None,
        help="W&B API key (default: W&B's own login or the WANDB_API_KEY environment variable, which is preferable: "
        "a flag is visible to every local user in `ps`); redacted from every output of lichen",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bars (default: off, bars are shown)")
    g.add_argument(
        "--log-samples",
        type=int,
        metavar="N",
        default=8,
        help="write N samples of every step (whole prompt groups first; prompt, response, tokens, reward, "
        "advantages, rollout and trainer log-probs) to <output-dir>/samples/step_*.jsonl.gz for the sample browser "
        "of `lichen report`; 0 turns the sample log off (default: 8)",
    )
    g.add_argument(
        "--trace",
        action="store_true",
        help="write <output-dir>/trace.json, a Chrome/Perfetto trace of the phases of every step (open it in "
        "ui.perfetto.dev or chrome://tracing; default: off)",
    )
    g.add_argument(
        "--watchdog-timeout",
        type=float,
        metavar="SECONDS",
        default=3600.0,
        help="when one phase (generate, reward, train, sync, eval, save) runs longer than this, write every "
        "thread's stack (and the engines') to <output-dir>/watchdog/, naming the phase; after a second timeout "
        "exit with code 3 unless --watchdog-wait; 0 turns the watchdog off (default: 3600)",
    )
    g.add_argument(
        "--watchdog-wait",
        action="store_true",
        help="after a watchdog dump keep waiting (and dump again after every further timeout) instead of exiting "
        "(default: off)",
    )


def check(args: argparse.Namespace) -> None:
    if not args.wandb_project:
        raise ConfigError("--wandb-project: must not be empty")
    if args.log_samples < 0:
        raise ConfigError(
            f"--log-samples: must be 0 (off) or a positive number of samples per step, got {args.log_samples}"
        )
    if args.watchdog_timeout < 0:
        raise ConfigError(
            f"--watchdog-timeout: must be 0 (off) or a positive number of seconds, got {args.watchdog_timeout:g}"
        )
