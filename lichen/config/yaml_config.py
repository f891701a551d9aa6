"""`--config FILE.yaml`: the same flags as the command line, as a YAML mapping; the command line wins.

Keys are flag names in either spelling (`rollout-batch-size` or `rollout_batch_size`). Values are typed as on
the command line: each value is turned into the argument tokens it stands for and parsed by the flag's own
argparse action, so types, choices and error texts are exactly the command line's. In particular:
- multi-value flags take a list (a mapping is flattened to key, value, ... as `--eval-prompt-data` wants);
- on/off flags (store_true) and --x/--no-x pairs take true or false;
- `train-env-vars` may be a mapping instead of a JSON string;
- null means "not given" (the flag keeps its default);
- unknown `sglang-*` keys are collected for SGLang servers, as on the command line.
Relative paths in the file are relative to the current directory, as on the command line. Every error names the
file, the line and the key.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
from typing import Any

import yaml

from lichen.config.parser import option_actions
from lichen.config.removed import removed_message
from lichen.config.rollout import SGLANG_PREFIX
from lichen.config.slime.flags import HINT_CUTOFF, SLIME_FLAGS
from lichen.errors import ConfigError


def find_config_path(argv: list[str]) -> str | None:
    """The value of the last `--config FILE` / `--config=FILE` in argv, or None."""
    path = None
    for i, token in enumerate(argv):
        if token == "--":
            break
        if token == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif token.startswith("--config="):
            path = token.split("=", 1)[1]
    return path


def load_yaml_config(path: str, parser: argparse.ArgumentParser) -> tuple[dict[str, Any], list[str]]:
    """Read `path` and parse each key with `parser`'s action for that flag.

    Returns (dest -> typed value for every key with a non-null value, pass-through `--sglang-*` tokens).
    """
    if not os.path.isfile(path):
        raise ConfigError(f"--config {path!r}: no such file; give a YAML file of flag: value lines")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config {path!r}: cannot read the file: {e}") from None

    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return {}, []
        if not isinstance(root, yaml.MappingNode):
            raise ConfigError(
                f"{path}:{root.start_mark.line + 1}: the config must be a mapping of flag names to values "
                "(e.g. `rollout-batch-size: 8`)"
            )
        entries = [(key_node, loader.construct_object(value_node, deep=True)) for key_node, value_node in root.value]
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path!r}: not valid YAML: {_yaml_problem(e)}") from None
    finally:
        loader.dispose()

    actions = option_actions(parser)
    known_flags = [s for s in actions if s.startswith("--") and s != "--help"]
    values: dict[str, Any] = {}
    passthrough: list[str] = []
    seen: dict[str, int] = {}
    for key_node, value in entries:
        line = key_node.start_mark.line + 1
        if not isinstance(key_node, yaml.ScalarNode):
            raise ConfigError(f"{path}:{line}: a key must be a flag name, not a list or mapping")
        key = key_node.value
        where = f"{path}:{line}: key {key!r}"
        flag = "--" + key.strip().lstrip("-").replace("_", "-")
        if flag in seen:
            raise ConfigError(f"{where}: {flag} is already set on line {seen[flag]}; keep one")
        seen[flag] = line
        message = removed_message(flag)
        if message is not None:
            raise ConfigError(f"{where}: {message}")
        if flag == "--config":
            raise ConfigError(f"{where}: a config file cannot name another config file; merge them into one")
        action = actions.get(flag)
        if action is None or action.dest == "help":
            if flag.startswith(SGLANG_PREFIX):
                passthrough += _sglang_tokens(flag, value)
                continue
            rule = SLIME_FLAGS.get(flag)
            if rule is not None:  # no fuzzy hint: --num-layers is not --num-threads
                raise ConfigError(
                    f"{where}: {flag} is a slime/Megatron flag ({rule.cls}: {rule.lichen}); a config "
                    "file takes lichen flags only: give it on the command line, where the flag table "
                    "classifies it, or convert the script with lichen port-slime"
                )
            close = difflib.get_close_matches(flag, known_flags, n=1, cutoff=HINT_CUTOFF)
            hint = f"; did you mean {close[0].lstrip('-')}?" if close else "; see lichen train --help"
            raise ConfigError(f"{where}: unknown flag {flag}{hint}")
        if value is None:
            continue
        if action.dest in values:
            raise ConfigError(f"{where}: {flag} is set twice in this file; keep one")
        values[action.dest] = _typed_value(parser, action, flag, value, where)
    return values, passthrough


def _typed_value(parser: argparse.ArgumentParser, action: argparse.Action, flag: str, value: Any, where: str) -> Any:
    """Parse `value` as the command line would parse the tokens it stands for."""
    if isinstance(action, argparse.BooleanOptionalAction):
        on = _expect_bool(value, where)
        if flag.startswith("--no-"):
            on = not on
        tokens = [action.option_strings[0] if on else action.option_strings[1]]
    elif action.nargs == 0:  # store_true
        if not _expect_bool(value, where):
            return False
        tokens = [flag]
    elif action.nargs in ("*", "+") or isinstance(action.nargs, int):
        tokens = [flag] + _list_items(value, where)
    else:
        if isinstance(value, dict) and action.dest == "train_env_vars":
            value = json.dumps(value)
        tokens = [f"{flag}={_scalar(value, where)}"]
    try:
        namespace, extras = parser.parse_known_args(tokens, namespace=argparse.Namespace())
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    assert not extras, extras  # tokens are built from the flag's own action
    return getattr(namespace, action.dest)


def _expect_bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    return value


def _scalar(value: Any, where: str) -> str:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a value, got {str(value).lower()} (quote it if you mean the text)")
    if isinstance(value, (list, dict)):
        raise ConfigError(f"{where}: expected one value, got a {'list' if isinstance(value, list) else 'mapping'}")
    return str(value)


def _list_items(value: Any, where: str) -> list[str]:
    if isinstance(value, dict):
        items: list[Any] = [x for pair in value.items() for x in pair]
    elif isinstance(value, list):
        items = value
    else:
        items = [value]
    return [_scalar(item, where) for item in items]


def _sglang_tokens(flag: str, value: Any) -> list[str]:
    if value is True or value is None:
        return [flag]
    if value is False:
        return []
    if isinstance(value, list):
        return [flag] + [str(v) for v in value]
    return [flag, str(value)]


def _yaml_problem(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem
