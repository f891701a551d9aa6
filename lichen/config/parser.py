"""The argparse parser that `lichen train` uses: errors become `ConfigError`, help shows defaults.

argparse's own `error()` prints the whole usage block and calls `sys.exit(2)`; lichen wants one clear line and
the same exit path as every other user mistake, so `error()` raises `ConfigError` and `lichen.cli` prints it.
`--help` is untouched: it prints and exits 0.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

from lichen.errors import ConfigError


class LichenArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise `ConfigError(message)` instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


class LichenHelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help unless the text already says it or there is nothing to say.

    Flags whose default is None or False explain in their own help text what happens when they are not given
    (e.g. "default: the rollout temperature"), since a bare "(default: None)" tells the user nothing.
    """

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=40, width=110)

    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        # "--lr X" reads better than "--lr LR"; choices and explicit metavars are shown as given.
        return {int: "N", float: "X"}.get(action.type, "VALUE")  # type: ignore[arg-type]

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False:
            return text
        if action.default is argparse.SUPPRESS:
            return text
        if action.option_strings and action.nargs != 0:
            return text + " (default: %(default)s)"
        return text


def flag_of(dest: str) -> str:
    """`rollout_batch_size` -> `--rollout-batch-size`."""
    return "--" + dest.replace("_", "-")


def option_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every option string of `parser` (`--x`, `--no-x`, `-h`) mapped to its action."""
    return dict(parser._option_string_actions)  # argparse keeps no public accessor for this map
