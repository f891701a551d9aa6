"""Prompt data flags: the file, which keys hold prompt/label/metadata/tools, chat template, shuffling."""

from __future__ import annotations

import argparse

from lichen.errors import ConfigError
from lichen.config.checks import check_data_file, check_int_at_least


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("prompt data")
    g.add_argument(
        "--prompt-data",
        metavar="PATH",
        default=None,
        help="(required unless replaying dumps with --load-debug-rollout-data) prompts as .jsonl or .parquet; "
        "PATH@[start:stop] keeps a row range, e.g. train.jsonl@[:1000]",
    )
    g.add_argument(
        "--input-key", metavar="KEY", default="prompt", help="row key holding the prompt (a string or chat messages)"
    )
    g.add_argument(
        "--label-key", metavar="KEY", default="label", help="row key holding the label the reward compares against"
    )
    g.add_argument("--metadata-key", metavar="KEY", default="metadata", help="row key holding a metadata object")
    g.add_argument(
        "--tool-key",
        metavar="KEY",
        default=None,
        help="row key holding tool definitions for the chat template (default: none)",
    )
    g.add_argument(
        "--apply-chat-template",
        action="store_true",
        help="render prompts with the tokenizer's chat template (default: off, the prompt text is used as is)",
    )
    g.add_argument(
        "--rollout-shuffle",
        action="store_true",
        help="shuffle the prompts each epoch, seeded by --rollout-seed (default: off, file order)",
    )
    g.add_argument("--rollout-seed", type=int, default=42, help="seed of the prompt shuffle")
    g.add_argument(
        "--rollout-max-prompt-len",
        type=int,
        default=None,
        help="drop prompts longer than this many tokens when loading (default: keep all)",
    )


def check(args: argparse.Namespace) -> None:
    if args.prompt_data is None:
        if not (args.debug_train_only and args.load_debug_rollout_data is not None):
            raise ConfigError(
                "--prompt-data is required: a .jsonl or .parquet file of prompts (only replaying dumps with "
                "--load-debug-rollout-data needs none)"
            )
    else:
        check_data_file(args.prompt_data, "--prompt-data")
    check_int_at_least(args, "rollout_max_prompt_len", 1)
    if not args.input_key:
        raise ConfigError("--input-key: must not be empty; give the row key that holds the prompt")
