"""Prompt data flags: the file, which keys hold prompt/label/metadata/tools, chat template, shuffling."""

from __future__ import annotations

import argparse

from lichen.config.checks import check_data_file, check_int_at_least
from lichen.errors import ConfigError
from lichen.models.config import model_positions

_ROW_BYTES_FLOOR = 32 << 20
# the default --max-prompt-chars allows this many characters per prompt token: real text averages 3 to 5 (code
# with long whitespace runs ~10), so only a prompt far over --rollout-max-prompt-len is dropped by its length in
# characters (lichen.data.fit)
CHARS_PER_TOKEN = 32


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
        "--rollout-max-context-len",
        type=int,
        default=None,
        help="most tokens one sample holds, prompt + response: each sample may generate min("
        "--rollout-max-response-len, this - prompt tokens) on every engine (default: the model's "
        "max_position_embeddings - 1, the most an engine serving the model's full context accepts)",
    )
    g.add_argument(
        "--rollout-max-prompt-len",
        type=int,
        default=None,
        help="drop prompts longer than this many tokens when loading, with a count in the log (default: "
        "--rollout-max-context-len - 1, so every kept prompt has room for at least one response token)",
    )
    g.add_argument(
        "--max-prompt-chars",
        type=int,
        default=None,
        help="drop, untokenized, prompts whose text (after the chat template) is longer than this many characters "
        "(default: 32 x --rollout-max-prompt-len, more than any prompt that fits holds): tokenizing costs ~100 "
        "bytes of memory per character, so one huge row must not reach the tokenizer",
    )
    g.add_argument(
        "--max-row-bytes",
        type=int,
        default=None,
        help="drop JSONL rows longer than this many bytes without reading them into memory, naming FILE:LINE "
        "(default: the larger of 32 MiB and 12 x --max-prompt-chars, room for the prompt in any JSON escaping "
        "plus a label and metadata); raise it for rows with very large metadata",
    )
    g.add_argument(
        "--skip-bad-rows",
        action="store_true",
        help="skip data rows that cannot be used (no or empty prompt, malformed JSON, bad metadata), logging each "
        "and their count (default: off, the first bad row stops the run before it starts, naming FILE:LINE)",
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
    _resolve_context(args)
    if not args.input_key:
        raise ConfigError("--input-key: must not be empty; give the row key that holds the prompt")


def _resolve_context(args: argparse.Namespace) -> None:
    """--rollout-max-context-len and --rollout-max-prompt-len (slime's rule: prompt <= context - 1).

    SGLang (and lichen serve) refuse a request whose prompt + max_new_tokens reaches the engine's context length
    C, so a sample of the model's C = max_position_embeddings positions holds at most C - 1 tokens; that is the
    default and the ceiling, which keeps the in-process engine, lichen serve and SGLang on the same budget.
    """
    positions = model_positions(args.hf_checkpoint)
    ceiling = positions - 1
    if args.rollout_max_context_len is None:
        args.rollout_max_context_len = ceiling
    check_int_at_least(args, "rollout_max_context_len", 2, " (a prompt token and a response token)")
    if args.rollout_max_context_len > ceiling:
        raise ConfigError(
            f"--rollout-max-context-len {args.rollout_max_context_len}: the model ({args.hf_checkpoint}) has "
            f"{positions} positions and an engine serving them accepts prompt + response < {positions} tokens; "
            f"use at most {ceiling}"
        )
    if args.rollout_max_prompt_len is None:
        args.rollout_max_prompt_len = args.rollout_max_context_len - 1
    check_int_at_least(args, "rollout_max_prompt_len", 1)
    if args.rollout_max_prompt_len > args.rollout_max_context_len - 1:
        raise ConfigError(
            f"--rollout-max-prompt-len {args.rollout_max_prompt_len} leaves no room for a response under "
            f"--rollout-max-context-len {args.rollout_max_context_len}; use at most "
            f"{args.rollout_max_context_len - 1}"
        )
    if args.max_prompt_chars is None:
        args.max_prompt_chars = CHARS_PER_TOKEN * args.rollout_max_prompt_len
    check_int_at_least(args, "max_prompt_chars", 1)
    if args.max_row_bytes is None:
        # a prompt character is at most 12 bytes of JSON (an escaped surrogate pair); the floor leaves room for
        # labels and metadata (test cases of code tasks run to megabytes)
        args.max_row_bytes = max(_ROW_BYTES_FLOOR, 12 * args.max_prompt_chars)
    check_int_at_least(args, "max_row_bytes", 1)
