"""Evaluation flags: named eval data sets, when to evaluate, and eval sampling (defaults follow the rollout).

Resolved fields: `args.eval_datasets` = [(name, path), ...] from `--eval-prompt-data NAME PATH ...`, and
eval_temperature / eval_top_p / eval_max_response_len / eval_rm_type fall back to their rollout counterparts.
"""

from __future__ import annotations

import argparse

from lichen.errors import ConfigError
from lichen.config.checks import check_data_file, check_float, check_int_at_least


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
        "--eval-interval",
        type=int,
        default=None,
        help="evaluate every N rollout steps (needs --eval-prompt-data; default: no periodic eval)",
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
    g.add_argument("--eval-rm-type", metavar="NAME", default=None, help="rule reward for eval (default: --rm-type)")


def check(args: argparse.Namespace) -> None:
    args.eval_datasets = []
    items = args.eval_prompt_data
    if items is not None:
        if len(items) % 2:
            raise ConfigError(
                f"--eval-prompt-data takes NAME PATH pairs, got {len(items)} values ({' '.join(items)}); e.g. "
                "--eval-prompt-data gsm8k test.jsonl"
            )
        names: set[str] = set()
        for name, path in zip(items[0::2], items[1::2]):
            if name in names:
                raise ConfigError(f"--eval-prompt-data: the name {name!r} is used twice; give each data set its name")
            names.add(name)
            check_data_file(path, f"--eval-prompt-data {name}")
            args.eval_datasets.append((name, path))
    if args.eval_interval is not None and not args.eval_datasets:
        raise ConfigError("--eval-interval needs --eval-prompt-data NAME PATH: the data sets to evaluate")
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
