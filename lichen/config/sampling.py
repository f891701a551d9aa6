"""DAPO flags: dynamic sampling (group filter, over-sampling, rounds) and the soft overlong penalty.

Resolved field: `args.over_sampling_batch_size` defaults to `--rollout-batch-size`. These flags act in lichen's
default rollout (lichen.rollout.generate.generate_rollout); a --rollout-function-path plug-in gets them only if
it calls that function.
"""

from __future__ import annotations

import argparse
import math

from lichen.errors import ConfigError
from lichen.config.checks import check_dotted_path, given

BUILTIN_NONZERO_STD = "lichen.rollout.filters.check_reward_nonzero_std"
# seed keys are rollout_id * 1000 + round (lichen.rollout.generate.SEED_ROUND_STRIDE): rounds must stay below it
MAX_ROUNDS_LIMIT = 1000


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "dynamic sampling and overlong penalty (DAPO)",
        description="Dynamic sampling regenerates until --rollout-batch-size prompt groups pass a filter; the "
        "overlong penalty lowers the reward of responses that run into the last tokens of the length budget.",
    )
    g.add_argument(
        "--dynamic-sampling-filter-path",
        metavar="MODULE.FUNCTION",
        default=None,
        help=f"keep a prompt group only if fn(args, group) returns True, e.g. {BUILTIN_NONZERO_STD} (drops groups "
        "whose rewards are all equal) (default: no filter, one round)",
    )
    g.add_argument(
        "--over-sampling-batch-size",
        type=int,
        default=None,
        help="prompts generated per dynamic-sampling round, >= --rollout-batch-size (default: --rollout-batch-size)",
    )
    g.add_argument(
        "--dynamic-sampling-max-rounds",
        type=int,
        default=10,
        help="most dynamic-sampling rounds per step; if fewer groups passed, the step trains on fewer and warns",
    )
    g.add_argument(
        "--overlong-buffer-len",
        type=int,
        default=None,
        help="B: responses longer than --rollout-max-response-len - B lose reward linearly, up to the penalty "
        "factor at the full length (default: no overlong penalty)",
    )
    g.add_argument(
        "--overlong-penalty-factor",
        type=float,
        default=1.0,
        help="the overlong penalty at the full response length (needs --overlong-buffer-len)",
    )


def check(args: argparse.Namespace) -> None:
    _check_overlong(args)
    _check_dynamic_sampling(args)


def _check_overlong(args: argparse.Namespace) -> None:
    limit = args.rollout_max_response_len
    buffer_len = args.overlong_buffer_len
    if buffer_len is None:
        if given(args, "overlong_penalty_factor"):
            raise ConfigError("--overlong-penalty-factor needs --overlong-buffer-len N: without it there is no penalty")
        return
    if limit is not None and not 0 < buffer_len <= limit:
        raise ConfigError(
            f"--overlong-buffer-len {buffer_len}: must be in (0, {limit}], i.e. at least 1 and at most "
            f"--rollout-max-response-len {limit}"
        )
    factor = args.overlong_penalty_factor
    if not (math.isfinite(factor) and factor >= 0):
        raise ConfigError(f"--overlong-penalty-factor {factor}: must be a finite number >= 0")


def _check_dynamic_sampling(args: argparse.Namespace) -> None:
    path = args.dynamic_sampling_filter_path
    if path is None:
        for dest, flag in (("over_sampling_batch_size", "--over-sampling-batch-size"),
                           ("dynamic_sampling_max_rounds", "--dynamic-sampling-max-rounds")):
            if given(args, dest):
                raise ConfigError(f"{flag} needs --dynamic-sampling-filter-path MODULE.FUNCTION (e.g. "
                                  f"{BUILTIN_NONZERO_STD}): without a filter there is one round and no over-sampling")
        return
    if args.num_epoch is not None:
        raise ConfigError(
            "--num-epoch with --dynamic-sampling-filter-path: over-sampling uses up an epoch's prompts in fewer "
            "steps than --num-epoch assumes; give --num-rollout instead"
        )
    check_dotted_path(args, "dynamic_sampling_filter_path")
    if path == BUILTIN_NONZERO_STD and args.n_samples_per_prompt < 2:
        raise ConfigError(
            f"--dynamic-sampling-filter-path {BUILTIN_NONZERO_STD} needs --n-samples-per-prompt >= 2 (got "
            f"{args.n_samples_per_prompt}): a group of one sample has no reward spread, so every group would be dropped"
        )
    rounds = args.dynamic_sampling_max_rounds
    if not 1 <= rounds <= MAX_ROUNDS_LIMIT:
        raise ConfigError(f"--dynamic-sampling-max-rounds {rounds}: must be in [1, {MAX_ROUNDS_LIMIT}]")
    batch = args.rollout_batch_size
    if args.over_sampling_batch_size is None:
        args.over_sampling_batch_size = batch
    elif batch is not None and args.over_sampling_batch_size < batch:
        raise ConfigError(
            f"--over-sampling-batch-size {args.over_sampling_batch_size}: must be >= --rollout-batch-size {batch} "
            "(it is the number of prompts generated per round, of which up to --rollout-batch-size are kept)"
        )
