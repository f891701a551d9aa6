"""`lichen train`: parse and validate the flags, then run the loop (or print the resolved config with --dry-run).

Secrets among the flags (see `lichen.observe.secrets`) are registered before anything is printed or written, so
that the dry-run output, the run's config.json, W&B's record of the config and of `sys.argv`, and every log line
show them redacted.
"""

from __future__ import annotations

import argparse
import os
import sys

from lichen.config import parse_train_args
from lichen.observe.secrets import redact_argv, redact_config, register_secrets


def resolved_config(args: argparse.Namespace) -> dict:
    """The public fields of `args` as plain YAML-able values (tuples become lists, private `_x` fields dropped)."""
    return {key: _plain(value) for key, value in sorted(vars(args).items()) if not key.startswith("_")}


def _plain(value):
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, set):
        return sorted(_plain(v) for v in value)
    return value


def hide_secrets(args: argparse.Namespace) -> None:
    """Register the secrets of the parsed flags and the environment, and redact them in `sys.argv` (which W&B
    records); the process's own command line in /proc stays as given, so prefer environment variables or key
    files for secrets."""
    register_secrets(vars(args))
    sys.argv[:] = redact_argv(sys.argv)


def show_table(text: str) -> None:
    """The slime flag table goes to stderr: it is printed before any error, and --dry-run's stdout stays YAML."""
    print(text, file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    args = parse_train_args(argv, show_table=show_table)
    hide_secrets(args)
    if args.runtime == "local":
        # the trainer runs in this process; with --runtime ray they go into the trainer actors' runtime_env only
        # (lichen.cluster.actor_group), and a Ray started from here must not pass them on to the engines
        os.environ.update(args.train_env_vars)
    if args.dry_run:
        import yaml

        if args.use_lora:  # the adapted modules, on stderr: stdout stays YAML
            from lichen.config.lora import describe

            print(describe(args), file=sys.stderr)

        sys.stdout.write(yaml.safe_dump(redact_config(resolved_config(args)), sort_keys=True, default_flow_style=False))
        return 0
    from lichen.lifetime import mark_run
    from lichen.loop import run  # imported only now: it pulls in torch and the models

    mark_run()  # LICHEN_RUN_ID, inherited by every process the run starts (docs/fault-tolerance.md)

    if args.async_train:  # one-step off-policy: generation of step k+1 overlaps training on step k
        from lichen.loop_async import train_loop_async

        run(args, driver=train_loop_async)
    elif args.fully_async:  # a rollout worker that generates all the time (lichen.rollout.fully_async)
        from lichen.loop_async import train_loop_fully_async

        run(args, driver=train_loop_fully_async)
    else:
        run(args)
    return 0
