"""The `deepscaler` and `deepscaler_lenient` rewards: math grading of only the answer part of a reasoning model's
response, which may also be graded against a list of accepted answers.

`deepscaler` (slime's rule): the answer part is the text after the last `</think>`; a response without one is
graded on the text after its first `###Response` (up to the next one), and a response with neither scores 0.0.
Its last `\\boxed{...}` is graded like `math` (`rules.strict_last_boxed`: no box, no credit).

`deepscaler_lenient` (lichen's): the response must contain `</think>` (no `###Response` fallback); the text after
the last one is graded like `math_lenient` (last boxed answer, or the last number when nothing is boxed).
"""

from __future__ import annotations

from typing import Any

from lichen.rewards.math_grader import label_answer, math_equal
from lichen.rewards.rules import extract_answer, strict_last_boxed

THINK_END = "</think>"
RESPONSE_MARK = "###Response"


def after_thinking(response: str) -> str | None:
    """The text after the last `</think>`, or None when there is none."""
    head, sep, tail = response.rpartition(THINK_END)
    return tail if sep else None


def answer_part(response: str) -> str | None:
    """slime's answer part: after the last `</think>`, else between the first and second `###Response`."""
    tail = after_thinking(response)
    if tail is None and RESPONSE_MARK in response:
        tail = response.split(RESPONSE_MARK)[1]
    return tail


def _any_equal(pred: str | None, label: Any, strict: bool) -> float:
    if pred is None:
        return 0.0
    labels = label if isinstance(label, (list, tuple)) else [label]
    refs = [r for r in (label_answer(x, strict=strict) for x in labels) if r is not None]
    return 1.0 if any(math_equal(pred, ref) for ref in refs) else 0.0


def grade_deepscaler(response: str, label: Any, metadata: dict | None = None) -> float:
    text = answer_part(response)
    return 0.0 if text is None else _any_equal(strict_last_boxed(text), label, strict=True)


def grade_deepscaler_lenient(response: str, label: Any, metadata: dict | None = None) -> float:
    text = after_thinking(response)
    return 0.0 if text is None else _any_equal(extract_answer(text), label, strict=False)
