"""Prompts that fit the context, decided when the data loads so that no sample is ever sent without room.

A kept prompt has 1 <= tokens <= --rollout-max-prompt-len (default --rollout-max-context-len - 1), so each of
its samples may generate min(--rollout-max-response-len, context - prompt tokens) >= 1 tokens. Longer prompts
are dropped with a count in the log (as slime filters by --rollout-max-prompt-len); a prompt that encodes to
no tokens at all is a bad row (DataError naming FILE:LINE, or skipped and counted with --skip-bad-rows).

Tokenizing is the costly step (a fast tokenizer holds ~100 bytes per character of input), so a prompt is measured
in characters first: one whose text is longer than --max-prompt-chars (default 32 characters per token of
--rollout-max-prompt-len, lichen.config.data) cannot fit and is dropped untokenized, named FILE:LINE in the log. The check
runs twice: on the prompt's own text before any chat template (so a huge message is never rendered either), and
on the rendered text (`encode` raises PromptTooLong), which covers template overhead, many empty messages and
tools. So the tokenizer never sees more than --max-prompt-chars characters of one prompt.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from lichen.data.dataset import PromptRecord, bad_row_hint, row_where
from lichen.errors import DataError, PromptTooLong

logger = logging.getLogger(__name__)

_NAMED_DROPS = 10  # rows named one by one in the log; the rest are counted


def prompt_chars(prompt: Any) -> int:
    """Characters of text a prompt holds before any chat template: the string, or the string contents and text
    parts of its messages. Image/audio/video parts are not text the tokenizer reads and do not count."""
    if isinstance(prompt, str):
        return len(prompt)
    total = 0
    for msg in prompt if isinstance(prompt, list) else ():
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                    total += len(part["text"])
    return total


def fit_prompts(
    records: list[PromptRecord],
    encode: Callable[[int, PromptRecord], list[int]],
    *,
    path: str,
    max_prompt_len: int | None,
    skip_bad_rows: bool,
    what: str = "--prompt-data",
    max_prompt_chars: int | None = None,
) -> list[PromptRecord]:
    """The records whose encoded prompt (`encode(index, record)`) is non-empty and at most `max_prompt_len`
    tokens (None: no limit); logs how many were dropped and why. A prompt over `max_prompt_chars` characters
    (None: no limit) is dropped before `encode` sees it; `encode` should raise PromptTooLong for rendered text
    over the same bound."""
    kept, too_long, empty, too_many_chars = [], 0, 0, 0
    for i, record in enumerate(records):
        line = record.source_line
        where = row_where(path, line) if line is not None else f"{what} prompt {i}"
        try:
            chars = prompt_chars(record.prompt)
            if max_prompt_chars is not None and chars > max_prompt_chars:
                raise PromptTooLong(chars, max_prompt_chars)
            n = len(encode(i, record))
        except PromptTooLong as e:
            too_many_chars += 1
            if too_many_chars <= _NAMED_DROPS:
                logger.warning("%s: %s: dropped %s without tokenizing (it cannot fit)", what, where, e)
            continue
        if n == 0:
            msg = f"{where}: the prompt encodes to no tokens (an engine needs at least one prompt token)"
            if not skip_bad_rows:
                raise DataError(msg + bad_row_hint(what))
            logger.warning("%s: skipping bad row: %s", what, msg)
            empty += 1
        elif max_prompt_len is not None and n > max_prompt_len:
            too_long += 1
            if too_long <= _NAMED_DROPS:
                logger.warning("%s: %s: dropped a prompt of %d tokens", what, where, n)
        else:
            kept.append(record)
    if too_long:
        logger.warning(
            "%s: dropped %d of %d prompts longer than --rollout-max-prompt-len %d tokens (no room left "
            "under --rollout-max-context-len)",
            what,
            too_long,
            len(records),
            max_prompt_len,
        )
    if too_many_chars:
        logger.warning(
            "%s: dropped %d of %d prompts longer than --max-prompt-chars %s characters, untokenized (they cannot "
            "fit --rollout-max-prompt-len %s tokens)",
            what,
            too_many_chars,
            len(records),
            max_prompt_chars,
            max_prompt_len,
        )
    if empty:
        logger.warning(
            "%s: skipped %d of %d prompts that encode to no tokens (--skip-bad-rows)", what, empty, len(records)
        )
    if not kept:
        raise DataError(
            f"{what} {path}: none of the {len(records)} prompts fits (longer than "
            f"--rollout-max-prompt-len {max_prompt_len} tokens or --max-prompt-chars {max_prompt_chars} "
            "characters, or empty); raise --rollout-max-context-len or use shorter prompts"
        )
    return kept
