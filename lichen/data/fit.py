"""Prompts that fit the context, decided when the data loads so that no sample is ever sent without room.

A kept prompt has 1 <= tokens <= --rollout-max-prompt-len (default --rollout-max-context-len - 1), so each of
its samples may generate min(--rollout-max-response-len, context - prompt tokens) >= 1 tokens. Longer prompts
are dropped with a count in the log (as slime filters by --rollout-max-prompt-len); a prompt that encodes to
no tokens at all is a bad row (DataError naming FILE:LINE, or skipped and counted with --skip-bad-rows).
"""

from __future__ import annotations

import logging
from typing import Callable

from lichen.data.dataset import PromptRecord, bad_row_hint, row_where
from lichen.errors import DataError

logger = logging.getLogger(__name__)


def fit_prompts(
    records: list[PromptRecord],
    encode: Callable[[int, PromptRecord], list[int]],
    *,
    path: str,
    max_prompt_len: int | None,
    skip_bad_rows: bool,
    what: str = "--prompt-data",
) -> list[PromptRecord]:
    """The records whose encoded prompt (`encode(index, record)`) is non-empty and at most `max_prompt_len`
    tokens (None: no limit); logs how many were dropped and why."""
    kept, too_long, empty = [], 0, 0
    for i, record in enumerate(records):
        n = len(encode(i, record))
        if n == 0:
            line = record.source_line
            where = row_where(path, line) if line is not None else f"{what} prompt {i}"
            msg = f"{where}: the prompt encodes to no tokens (an engine needs at least one prompt token)"
            if not skip_bad_rows:
                raise DataError(msg + bad_row_hint(what))
            logger.warning("%s: skipping bad row: %s", what, msg)
            empty += 1
        elif max_prompt_len is not None and n > max_prompt_len:
            too_long += 1
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
    if empty:
        logger.warning(
            "%s: skipped %d of %d prompts that encode to no tokens (--skip-bad-rows)", what, empty, len(records)
        )
    if not kept:
        raise DataError(
            f"{what} {path}: none of the {len(records)} prompts fits (longer than "
            f"--rollout-max-prompt-len {max_prompt_len} tokens or empty); raise --rollout-max-context-len "
            "or use shorter prompts"
        )
    return kept
