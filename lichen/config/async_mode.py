"""Asynchronous training flags: `--async` (one-step off-policy, slime's train_async.py), `--fully-async` (a
long-lived rollout worker, slime's examples/fully_async plug-in), `--update-weights-interval`, `--max-staleness`
and `--max-staleness-action`.

With `--async` the engines generate rollout k+1 with the weights of version k while the trainer trains on rollout
k (lichen/loop_async.py, docs/async.md). Both sides must run at once, so the rules refuse what makes them take
turns: --colocate and the offload flags (one side releases its memory while the other works) and the in-process
engine (it runs in the trainer's process, on its device and threads). `--fully-async` follows the same rules and
also needs a rollout lichen itself makes (no --rollout-function-path / --custom-generate-function-path: the worker
replaces the rollout function and aborts its own requests at each sync). Checked after placement (`colocate` and the
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
    g.add_argument(
        "--fully-async",
        action="store_true",
        help="a long-lived rollout worker keeps the engines busy and fills a buffer of finished groups; each step "
        "trains on --rollout-batch-size of them; at a sync the requests in flight are aborted and continued later "
        "with their partial tokens (slime: the examples/fully_async rollout-function plug-in) (default: off)",
    )
    g.add_argument(
        "--max-staleness",
        type=int,
        default=None,
        metavar="S",
        help="with --fully-async: a group whose oldest response segment is more than S weight versions behind the "
        "trainer is dropped or loss-masked (--max-staleness-action); counted in the metrics (default: no bound)",
    )
    g.add_argument(
        "--max-staleness-action",
        choices=["drop", "mask"],
        default="drop",
        help="with --max-staleness: drop a too-stale group (the next ready one takes its place) or train it with a "
        "zero loss mask (default: drop)",
    )


def check(args: argparse.Namespace) -> None:
    check_int_at_least(args, "update_weights_interval", 1)
    if args.max_staleness is not None:
        check_int_at_least(args, "max_staleness", 0)
        if not args.fully_async:
            raise ConfigError(
                f"--max-staleness {args.max_staleness} needs --fully-async (with --async a sample is at "
                "most --update-weights-interval versions old); add --fully-async or drop the flag"
            )
    if args.async_train and args.fully_async:
        raise ConfigError("--async and --fully-async are two different drivers; give one of them")
    interval = args.update_weights_interval
    if not (args.async_train or args.fully_async):
        if interval != 1:
            raise ConfigError(
                f"--update-weights-interval {interval} needs --async or --fully-async: the "
                "synchronous loop syncs after every step; add one of them or drop the flag"
            )
        return
    mode = "--fully-async" if args.fully_async else "--async"
    if args.fully_async:
        for dest in ("rollout_function_path", "custom_generate_function_path"):
            if getattr(args, dest):
                flag = "--" + dest.replace("_", "-")
                raise ConfigError(
                    f"--fully-async is refused with {flag}: its worker makes and aborts the engine "
                    f"requests itself, in place of a rollout plug-in; drop {flag} or --fully-async"
                )
    if args.colocate:
        raise ConfigError(
            f"{mode} is refused with --colocate: generation and training run at the same time, so "
            f"they cannot take turns on the same devices; drop --colocate or {mode}"
        )
    for dest in ("offload_train", "offload_rollout"):
        if getattr(args, dest):
            flag = "--" + dest.replace("_", "-")
            raise ConfigError(
                f"{mode} is refused with {flag}: both sides stay busy at once, neither can release "
                f"its memory; give --no-{flag[2:]} or drop {mode}"
            )
    if args.load_debug_rollout_data:
        raise ConfigError(f"{mode} has nothing to overlap with --load-debug-rollout-data (no generation); drop {mode}")
    if args.rollout_num_engines is None and args.rollout_external_engine_addrs is None:
        raise ConfigError(
            f"{mode} needs server engines (--rollout-num-engines K or --rollout-external-engine-addrs): "
            "the in-process engine runs in the trainer's process on its device and threads, so "
            "generation could not overlap training"
        )
    # a checkpoint or an eval must see the engines at the version just trained: both fall on sync steps
    for dest, flag in (("save_interval", "--save-interval"), ("eval_interval", "--eval-interval")):
        value = getattr(args, dest)
        if value is not None and value % interval:
            raise ConfigError(
                f"{flag} {value} with {mode}: give a multiple of --update-weights-interval {interval}, "
                "so that checkpoints and evals fall on the steps that sync the engines"
            )
