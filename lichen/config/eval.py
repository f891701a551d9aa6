"""Evaluation flags: named eval data sets, when to evaluate, eval sampling, and `--eval-config FILE.yaml`.

Resolved fields:
- `args.eval_datasets` = [(name, path), ...]: every eval data set, `--eval-prompt-data NAME PATH ...` pairs first,
  then the `--eval-config` entries;
- `args.eval_dataset_configs` = [{field: value}, ...] in the same order, each with every field of EVAL_FIELDS
  resolved by the order: the data set's own entry > the file's `defaults` > the flags (--eval-temperature,
  --eval-top-p, --rollout-top-k, --eval-max-response-len, --n-samples-per-eval-prompt, --eval-rm-type,
  --eval-reward-key, --input-key, …), where the eval flags themselves fall back to their rollout counterparts;
- eval_temperature / eval_top_p / eval_max_response_len / eval_rm_type / eval_reward_key after those fallbacks.
A data set's reward is `rm_type` or `custom_rm_path`, whichever the highest level that names one gives.

The eval config file:
    defaults:                       # optional, applies to every data set
      n_samples_per_eval_prompt: 4
      temperature: 0.6
    datasets:                       # required: a list of entries with at least name and path
      - name: aime
        path: data/aime.jsonl@[:30]   # relative to the current directory, as on the command line
        rm_type: deepscaler
        max_response_len: 4096
An unknown key anywhere is an error naming the key, the file and the line.
"""

from __future__ import annotations

import argparse
import difflib
from typing import Any, Callable

from lichen.config.checks import check_data_file, check_float, check_int_at_least
from lichen.errors import ConfigError


def _str(v: Any) -> bool:
    return isinstance(v, str) and v != ""


def _int_at_least(low: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low


def _number(low: float, high: float | None = None, low_open: bool = False) -> Callable[[Any], bool]:
    def ok(v: Any) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
            return False
        return (v > low if low_open else v >= low) and (high is None or v <= high)

    return ok


# field -> (validator, what a valid value is)
EVAL_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "name": (_str, "a non-empty string"),
    "path": (_str, "a data file path (optionally PATH@[start:stop])"),
    "rm_type": (_str, "an rm type name"),
    "custom_rm_path": (_str, "a dotted path module.function"),
    "reward_key": (_str, "a key of the dict reward"),
    "input_key": (_str, "a row key"),
    "label_key": (_str, "a row key"),
    "metadata_key": (_str, "a row key"),
    "tool_key": (_str, "a row key"),
    "apply_chat_template": (lambda v: isinstance(v, bool), "true or false"),
    "n_samples_per_eval_prompt": (_int_at_least(1), "an integer >= 1"),
    "temperature": (_number(0.0), "a number >= 0"),
    "top_p": (_number(0.0, 1.0, low_open=True), "a number in (0, 1]"),
    "top_k": (lambda v: isinstance(v, int) and not isinstance(v, bool) and (v == -1 or v >= 1), "-1 or >= 1"),
    "max_response_len": (_int_at_least(1), "an integer >= 1"),
}
_OPTIONAL_NONE = ("rm_type", "custom_rm_path", "reward_key", "metadata_key", "tool_key", "label_key")
_PER_DATASET_ONLY = ("name", "path")


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("evaluation")
    g.add_argument(
        "--eval-prompt-data",
        nargs="+",
        metavar="NAME PATH",
        default=None,
        help="eval data sets as name/path pairs, e.g. gsm8k test.jsonl aime aime.jsonl@[:30] (default: no eval)",
    )
    g.add_argument(
        "--eval-config",
        metavar="FILE.yaml",
        default=None,
        help="eval data sets with per-data-set settings (rm_type, keys, sampling, samples per prompt) under "
        "`datasets:`, shared ones under `defaults:`; entry > defaults > flags (default: none)",
    )
    g.add_argument(
        "--eval-interval",
        type=int,
        default=None,
        help="evaluate every N rollout steps (needs --eval-prompt-data or --eval-config; default: no periodic eval)",
    )
    g.add_argument(
        "--skip-eval-before-train",
        action="store_true",
        help="skip the eval of weight version 0 before training (default: off, it runs when --eval-interval is set)",
    )
    g.add_argument("--n-samples-per-eval-prompt", type=int, default=1, help="samples per eval prompt")
    g.add_argument(
        "--eval-temperature",
        type=float,
        default=None,
        help="eval sampling temperature; 0 is greedy (default: --rollout-temperature)",
    )
    g.add_argument(
        "--eval-top-p", type=float, default=None, help="eval nucleus sampling mass (default: --rollout-top-p)"
    )
    g.add_argument(
        "--eval-max-response-len",
        type=int,
        default=None,
        help="most tokens per eval response (default: --rollout-max-response-len)",
    )
    g.add_argument("--eval-rm-type", metavar="NAME", default=None, help="rm type for eval (default: --rm-type)")
    g.add_argument(
        "--eval-reward-key",
        metavar="KEY",
        default=None,
        help="key of a dict reward read by eval metrics (default: --reward-key)",
    )


def check(args: argparse.Namespace) -> None:
    # reward flags are resolved here, before the eval fallbacks that read --rm-type
    from lichen.config import rewards

    rewards.check(args)
    check_int_at_least(args, "eval_interval", 1)
    check_int_at_least(args, "n_samples_per_eval_prompt", 1)
    if args.eval_temperature is None:
        args.eval_temperature = args.rollout_temperature
    check_float(args, "eval_temperature", low=0.0)
    if args.eval_top_p is None:
        args.eval_top_p = args.rollout_top_p
    check_float(args, "eval_top_p", low=0.0, high=1.0, low_open=True)
    if args.eval_max_response_len is None:
        args.eval_max_response_len = args.rollout_max_response_len
    check_int_at_least(args, "eval_max_response_len", 1)
    if args.eval_rm_type is None:
        args.eval_rm_type = args.rm_type
    else:
        from lichen.rewards.hub import check_rm_type

        check_rm_type(args.eval_rm_type, "--eval-rm-type")
    if args.eval_reward_key is None:
        args.eval_reward_key = args.reward_key

    base = flag_level(args)
    entries = [{"name": n, "path": p} for n, p in _prompt_data_pairs(args.eval_prompt_data)]
    where = [f"--eval-prompt-data {e['name']}" for e in entries]
    defaults: dict = {}
    if args.eval_config is not None:
        defaults, file_entries = load_eval_config(args.eval_config)
        entries += file_entries
        where += [f"--eval-config {args.eval_config}: datasets[{i}] ({e['name']})" for i, e in enumerate(file_entries)]
    configs, seen = [], set()
    for entry, origin in zip(entries, where):
        if entry["name"] in seen:
            raise ConfigError(f"{origin}: the eval data set name {entry['name']!r} is used twice; give each its own")
        seen.add(entry["name"])
        configs.append(resolve_dataset(entry, defaults, base, origin))
    args.eval_dataset_configs = configs
    args.eval_datasets = [(c["name"], c["path"]) for c in configs]
    if args.eval_interval is not None and not configs:
        raise ConfigError(
            "--eval-interval needs --eval-prompt-data NAME PATH or --eval-config FILE.yaml: the data sets to evaluate"
        )


def _prompt_data_pairs(items: list[str] | None) -> list[tuple[str, str]]:
    if items is None:
        return []
    if len(items) % 2:
        raise ConfigError(
            f"--eval-prompt-data takes NAME PATH pairs, got {len(items)} values ({' '.join(items)}); e.g. "
            "--eval-prompt-data gsm8k test.jsonl"
        )
    return list(zip(items[0::2], items[1::2]))


def flag_level(args: argparse.Namespace) -> dict:
    """The lowest level of the resolution: every EVAL_FIELDS value (but name/path) as the flags give it."""
    rm_type = args.eval_rm_type
    return {
        "rm_type": rm_type,
        "custom_rm_path": None if rm_type is not None else args.custom_rm_path,
        "reward_key": args.eval_reward_key,
        "input_key": args.input_key,
        "label_key": args.label_key,
        "metadata_key": args.metadata_key,
        "tool_key": args.tool_key,
        "apply_chat_template": bool(args.apply_chat_template),
        "n_samples_per_eval_prompt": args.n_samples_per_eval_prompt,
        "temperature": args.eval_temperature,
        "top_p": args.eval_top_p,
        "top_k": args.rollout_top_k,
        "max_response_len": args.eval_max_response_len,
    }


def resolve_dataset(entry: dict, defaults: dict, base: dict, origin: str) -> dict:
    """entry > defaults > base, field by field; the reward (rm_type or custom_rm_path) as one unit."""
    out = dict(base)
    for level in (defaults, entry):
        if level.get("rm_type") is not None or level.get("custom_rm_path") is not None:
            out["rm_type"], out["custom_rm_path"] = level.get("rm_type"), level.get("custom_rm_path")
        out.update({k: v for k, v in level.items() if k not in ("rm_type", "custom_rm_path")})
    check_data_file(out["path"], origin)
    if out["rm_type"] is not None and out["custom_rm_path"] is not None:
        raise ConfigError(f"{origin}: rm_type and custom_rm_path exclude each other; give one")
    if out["rm_type"] is not None:
        from lichen.rewards.hub import check_rm_type

        check_rm_type(out["rm_type"], f"{origin}: rm_type")
    elif out["custom_rm_path"] is not None:
        from lichen.plugins import load_function

        load_function(out["custom_rm_path"], f"{origin}: custom_rm_path")
    return out


def load_eval_config(path: str) -> tuple[dict, list[dict]]:
    """(defaults, dataset entries) of an eval config file, every key and value checked."""
    import os

    import yaml

    if not os.path.isfile(path):
        raise ConfigError(f"--eval-config {path!r}: no such file; give a YAML file with a `datasets:` list")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--eval-config {path!r}: cannot read the file: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--eval-config {path!r}: not valid YAML: {e}") from None
    lines = _key_lines(node)

    def fail(keys: tuple, message: str) -> ConfigError:
        line = lines.get(keys)
        return ConfigError(f"--eval-config {path}{f':{line}' if line else ''}: {message}")

    if not isinstance(data, dict):
        raise fail((), "the file must be a mapping with a `datasets:` list (and optionally `defaults:`)")
    for key in data:
        if key not in ("datasets", "defaults"):
            raise fail(
                (key,),
                f"unknown key {key!r}{_suggest(key, ('datasets', 'defaults'))}; the top level "
                "holds `datasets:` and `defaults:`",
            )
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise fail(("defaults",), "`defaults:` must be a mapping of field: value")
    _check_fields(defaults, ("defaults",), fail, allow=set(EVAL_FIELDS) - set(_PER_DATASET_ONLY))
    datasets = data.get("datasets")
    if not isinstance(datasets, list) or not datasets:
        raise fail(
            ("datasets",) if "datasets" in data else (),
            "`datasets:` must be a non-empty list of entries with at least `name:` and `path:`",
        )
    entries = []
    for i, entry in enumerate(datasets):
        if not isinstance(entry, dict):
            raise fail(("datasets", i), f"datasets[{i}] must be a mapping with name: and path:")
        _check_fields(entry, ("datasets", i), fail, allow=set(EVAL_FIELDS))
        for required in _PER_DATASET_ONLY:
            if required not in entry:
                raise fail(("datasets", i), f"datasets[{i}] has no `{required}:`")
        entries.append(dict(entry))
    return dict(defaults), entries


def _check_fields(mapping: dict, at: tuple, fail: Callable[..., ConfigError], allow: set) -> None:
    label = ".".join(str(a) if isinstance(a, str) else f"[{a}]" for a in at).replace(".[", "[")
    for key, value in mapping.items():
        if key not in allow:
            hint = " (only a data set entry has it)" if key in EVAL_FIELDS else _suggest(key, allow)
            raise fail(at + (key,), f"unknown key {key!r} in {label}{hint}; known: {', '.join(sorted(allow))}")
        if value is None and key in _OPTIONAL_NONE:
            continue
        ok, what = EVAL_FIELDS[key]
        if not ok(value):
            raise fail(at + (key,), f"{label}.{key} = {value!r}: must be {what}")


def _suggest(key: Any, known: Any) -> str:
    close = difflib.get_close_matches(str(key), [str(k) for k in known], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _key_lines(node: Any, at: tuple = ()) -> dict:
    """(key path) -> 1-based line of that key (or list item) in the YAML text."""
    import yaml

    out: dict = {}
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = (*at, k.value)
            out[key] = k.start_mark.line + 1
            out.update(_key_lines(v, key))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            key = (*at, i)
            out[key] = item.start_mark.line + 1
            out.update(_key_lines(item, key))
    return out
