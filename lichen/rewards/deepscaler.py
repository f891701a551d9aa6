"""The `deepscaler` reward: math grading of only the part of a reasoning model's response after its thinking.

The response must contain `</think>`; the text after the last one is graded like `math` (last boxed answer, or
the last number when nothing is boxed) against the label, which may also be a list of accepted answers.
A response without `</think>` never finished thinking and scores 0.0.
"""

from __future__ import annotations

from typing import Any

from lichen.rewards.math_grader import label_answer, math_equal
from lichen.rewards.rules import extract_answer

THINK_END = "</think>"


def after_thinking(response: str) -> str | None:
    """The text after the last `</think>`, or None when there is none."""
    head, sep, tail = response.rpartition(THINK_END)
    return tail if sep else None


def grade_deepscaler(response: str, label: Any, metadata: dict | None = None) -> float:
    answer_text = after_thinking(response)
    if answer_text is None:
        return 0.0
    pred = extract_answer(answer_text)
    if pred is None:
        return 0.0
    labels = label if isinstance(label, (list, tuple)) else [label]
    refs = [r for r in (label_answer(x) for x in labels) if r is not None]
    return 1.0 if any(math_equal(pred, ref) for ref in refs) else 0.0
