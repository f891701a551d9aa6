"""`lichen train` flags: one module per flag group, a YAML config file, removed flags, and validation.

`parse_train_args(argv)` runs, in order:
1. removed flags (their own message, not "unrecognized argument");
2. `--config FILE.yaml` (its values become the starting namespace, so the command line wins);
3. argparse, whose errors raise ConfigError (one line, exit 2 through lichen.cli); unknown `--sglang-*`
   arguments are collected into `args.sglang_passthrough`;
4. resolution of derived values and validation (validate.py), all before any model loads.
`args._explicit` holds the dests given on the command line or in the config file.

Nothing here imports torch: `lichen train --dry-run` stays fast.
"""

from __future__ import annotations

import argparse
from typing import Callable

from lichen.config import (  # noqa: E501
    algo,
    checkpoint,
    data,
    debug,
    eval,
    lora,
    model,
    observe,
    placement,
    rewards,
    rollout,
    sampling,
    sync,
    tools,
    train,
)
from lichen.config.engine_config import EngineConfig, ObserveConfig, SyncConfig
from lichen.config.parser import LichenArgumentParser, LichenHelpFormatter, option_actions
from lichen.config.removed import REMOVED_FLAGS, check_removed
from lichen.config.rollout import SGLANG_CONSUMED_FLAGS, collect_sglang_passthrough
from lichen.config.rollout_config import DataConfig, RewardConfig, RolloutConfig, SamplingConfig
from lichen.config.slime import compat as slime_compat
from lichen.config.train_config import OptimizerConfig, TrainerConfig
from lichen.config.validate import resolve_and_validate
from lichen.config.yaml_config import find_config_path, load_yaml_config
from lichen.errors import ConfigError

# The order of the sections in --help.
HELP_ORDER = (
    model,
    data,
    rollout,
    tools,
    rewards,
    sampling,
    train,
    lora,
    algo,
    placement,
    sync,
    debug,
    checkpoint,
    eval,
    observe,
)

__all__ = [
    "DataConfig",
    "EngineConfig",
    "ObserveConfig",
    "REMOVED_FLAGS",
    "RewardConfig",
    "RolloutConfig",
    "OptimizerConfig",
    "SGLANG_CONSUMED_FLAGS",
    "SamplingConfig",
    "SyncConfig",
    "TrainerConfig",
    "build_train_parser",
    "parse_train_args",
    "resolve_and_validate",
]


def build_train_parser() -> argparse.ArgumentParser:
    """The parser of `lichen train`: every flag group's arguments, errors raised as ConfigError."""
    parser = LichenArgumentParser(
        prog="lichen train",
        description="Run the RL loop: rollout -> train -> weight sync. Flags may also come from --config FILE.yaml; "
        "the command line wins.",
        epilog=f"--sglang-<flag> arguments other than {', '.join(SGLANG_CONSUMED_FLAGS)} are passed to the SGLang "
        "servers lichen launches. Removed flags: " + ", ".join(REMOVED_FLAGS) + ".",
        formatter_class=LichenHelpFormatter,
        allow_abbrev=False,
    )
    for group in HELP_ORDER:
        group.add_args(parser)
    return parser


def parse_train_args(
    argv: list[str],
    show_table: Callable[[str], None] | None = None,
    extra_rows: list[slime_compat.Row] | None = None,
) -> argparse.Namespace:
    """Parse, resolve and validate `lichen train` arguments; a user mistake raises ConfigError.

    Every flag is classified first (slime_compat): when slime/Megatron flags are present, `show_table` gets the
    class table before any error, and all flags that stop the run are named in one ConfigError, together with the
    first rule the remaining flags break. `extra_rows` (from `lichen port-slime`) join the table."""
    argv = [str(a) for a in argv]
    parser = build_train_parser()
    if any(token in ("-h", "--help") for token in _before_double_dash(argv)):
        parser.parse_known_args(["--help"])  # prints help, exits 0
    known_flags = [s for s in option_actions(parser) if s.startswith("--")]
    found = slime_compat.scan(argv, set(known_flags), extra_rows)
    if not found.slime:
        check_removed(argv)  # a lichen invocation keeps the one-message path
    argv = found.kept
    config_path = find_config_path(argv)
    yaml_values: dict = {}
    yaml_passthrough: list[str] = []
    if config_path is not None:
        yaml_values, yaml_passthrough = load_yaml_config(config_path, parser)
    args, extras = parser.parse_known_args(argv, namespace=argparse.Namespace(**yaml_values))
    args.sglang_passthrough = yaml_passthrough + collect_sglang_passthrough(extras, known_flags)
    args._explicit = set(yaml_values) | _explicit_dests(argv)
    args._slime_rows = found.rows if found.slime else []
    slime_compat.finish(found, args)
    stops = slime_compat.blocking_message(found.rows)
    if found.slime and show_table is not None:
        show_table(slime_compat.table(found.rows))
    if stops is None:
        return resolve_and_validate(args)
    try:
        resolve_and_validate(args)
    except ConfigError as e:  # one run says everything: the flags that stop it and the first other problem
        stops += f"; also: {e}"
    raise ConfigError(stops)


def _before_double_dash(argv: list[str]) -> list[str]:
    return argv[: argv.index("--")] if "--" in argv else argv


def _explicit_dests(argv: list[str]) -> set[str]:
    """Dests given on the command line: re-parse with every default suppressed, so only given flags appear."""
    parser = build_train_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    namespace, _ = parser.parse_known_args(argv)
    return set(vars(namespace))
