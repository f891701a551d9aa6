"""Asynchronous training flags: `--async` (one-step off-policy, slime's train_async.py) and
`--update-weights-interval`.

With `--async` the engines generate rollout k+1 with the weights of version k while the trainer trains on rollout
k (lichen/loop_async.py, docs/async.md). Both sides must run at once, so the rules refuse what makes them take
turns: --colocate and the offload flags (one side releases its memory while the other works) and the in-process
engine (it runs in the trainer's process, on its device and threads). Checked after placement (`colocate` and the
offloads are resolved by then), called from lichen.config.sync.
"""

from __future__ import annotations

import argparse

from lichen.config.checks import check_int_at_least
from lichen.errors import ConfigError


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("asynchronous training (docs/async.md)")
    g.add_argument(
        "--async-train",
        "--async",  # the short name; the first one is the dest's (args.async would be a syntax error)
        dest="async_train",
        action="store_true",
        help="one-step off-policy: engines generate rollout k+1 with the weights of version k while the trainer "
        "trains on rollout k (slime's train_async.py); needs server engines, refused with --colocate (default: off)",
    )
    g.add_argument(
        "--update-weights-interval",
        type=int,
        default=1,
        metavar="N",
        help="with --async: push the trainer's weights to the engines every N train steps (and after the last)",
    )


def check(args: argparse.Namespace) -> None:
    check_int_at_least(args, "update_weights_interval", 1)
    interval = args.update_weights_interval
    if not args.async_train:
        if interval != 1:
            raise ConfigError(f"--update-weights-interval {interval} needs --async: the synchronous loop syncs after "
                              "every step; add --async or drop the flag")
        return
    if args.colocate:
        raise ConfigError("--async is refused with --colocate: generation and training run at the same time, so "
                          "they cannot take turns on the same devices; drop --colocate or --async")
    for dest in ("offload_train", "offload_rollout"):
        if getattr(args, dest):
            flag = "--" + dest.replace("_", "-")
            raise ConfigError(f"--async is refused with {flag}: both sides stay busy at once, neither can release "
                              f"its memory; give --no-{flag[2:]} or drop --async")
    if args.load_debug_rollout_data:
        raise ConfigError("--async has nothing to overlap with --load-debug-rollout-data (no generation); drop --async")
    if args.rollout_num_engines is None and args.rollout_external_engine_addrs is None:
        raise ConfigError("--async needs server engines (--rollout-num-engines K or --rollout-external-engine-addrs): "
                          "the in-process engine runs in the trainer's process on its device and threads, so "
                          "generation could not overlap training")
    # a checkpoint or an eval must see the engines at the version just trained: both fall on sync steps
    for dest, flag in (("save_interval", "--save-interval"), ("eval_interval", "--eval-interval")):
        value = getattr(args, dest)
        if value is not None and value % interval:
            raise ConfigError(f"{flag} {value} with --async: give a multiple of --update-weights-interval {interval}, "
                              "so that checkpoints and evals fall on the steps that sync the engines")
