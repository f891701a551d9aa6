"""The `math` and `math_lenient` rewards: a response's final answer judged equivalent to the label by math-verify.

Grading of one (response, label):
1. label: `str(label)`, or the content of its own `\\boxed{}` when it has one; an empty label scores 0;
2. prediction:
   - `math` (slime's rule): the content of the response's last `\\boxed{...}` (`rules.strict_last_boxed`); a
     response without one, or whose last `\\boxed` is not a balanced `\\boxed{...}`, scores 0;
   - `math_lenient` (lichen's): `rules.extract_answer(response)` — the last balanced `\\boxed{}` (`\\fbox{}` when
     there is no `\\boxed`), or the last number of a response with no box at all; none scores 0;
3. equivalence, cheapest first:
   a. the two strings after `rules.normalize_answer` are equal (handles `\\dfrac`, `\\left(`, `\\text{}`, `.5`, …);
   b. both parse as plain numbers (fractions, `a/b`, `1,000`) and |a - b| <= 1e-6 * max(1, |b|);
   c. math-verify parses both as LaTeX/expressions and `verify(gold, pred)` holds (symbolic equality via sympy:
      `x+1` ≡ `1+x`, `\\frac{\\sqrt2}{2}` ≡ `\\sqrt{2}/2`, `50\\%` ≡ `0.5`, sets, intervals, equations
      `x=3` ≡ `3`).
Step 3 is lichen's own: slime judges equivalence with Hendrycks' MATH normalisation and sympy, so an edge case
(an unreduced fraction such as `2/4` for `1/2`, `50\\%` for `0.5`) can be judged differently there.

math-verify bounds its own work with SIGALRM, which only the main thread may arm; on any other thread it runs
without that bound (the reward runner's per-sample timeout still abandons the call). math-verify warns about that
("Timeout is disabled as parsing_timeout is None…", once from its parser and once from its grader per process);
lichen drops exactly those two lines (`_TimeoutDisabledFilter`), since the bound it asks for is the runner's and
nothing is left for the user to do; math-verify's other messages pass. Without math-verify installed, steps a and
b alone decide.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

from lichen.rewards.rules import answers_equal, extract_answer, last_boxed, normalize_answer, strict_last_boxed

# seconds math-verify may spend parsing one answer and comparing two (its own SIGALRM bound)
MATH_VERIFY_TIMEOUT_S = 5

_mv: Any = None  # the math_verify module once imported; False when it is not installed

# the loggers that warn when math-verify runs without its SIGALRM timeout (math-verify 0.9: parse and verify)
_TIMEOUT_WARNING_LOGGERS = ("math_verify.parser", "math_verify.grader")


class _TimeoutDisabledFilter(logging.Filter):
    """Drops math-verify's "Timeout is disabled as … is None or <= 0" warning: lichen passes no timeout off the
    main thread on purpose (SIGALRM is main-thread only) and bounds each call with --reward-timeout instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled as ")


def _math_verify() -> Any:
    global _mv
    if _mv is None:
        try:
            import math_verify
        except ImportError:  # a declared dependency; the basic checks still work without it
            _mv = False
        else:
            for name in _TIMEOUT_WARNING_LOGGERS:
                logger = logging.getLogger(name)
                if not any(isinstance(f, _TimeoutDisabledFilter) for f in logger.filters):
                    logger.addFilter(_TimeoutDisabledFilter())
            _mv = math_verify
    return _mv


def math_verify_available() -> bool:
    return bool(_math_verify())


@functools.lru_cache(maxsize=4096)  # a label is parsed once for all the samples of its prompt
def _parse(text: str, timeout: int | None) -> Any:
    mv = _math_verify()
    config = [mv.LatexExtractionConfig(boxed_match_priority=0), mv.ExprExtractionConfig()]
    return mv.parse(f"${text}$", extraction_config=config, parsing_timeout=timeout)


def _symbolic_equal(pred: str, ref: str) -> bool:
    mv = _math_verify()
    if not mv:
        return False
    on_main = threading.current_thread() is threading.main_thread()
    timeout = MATH_VERIFY_TIMEOUT_S if on_main else None
    try:
        gold, target = _parse(ref, timeout), _parse(pred, timeout)
        if not gold or not target:
            return False
        return bool(mv.verify(gold, target, timeout_seconds=timeout))
    except Exception:  # math-verify raising on odd input means "not shown equal", not a verifier crash
        return False


def math_equal(pred: str, ref: str) -> bool:
    """Whether two answer strings denote the same mathematical object (steps a-c of the module docstring)."""
    if normalize_answer(ref) == "" or normalize_answer(pred) == "":
        return False
    if answers_equal(pred, ref):
        return True
    return _symbolic_equal(pred, ref)


def label_answer(label: Any, *, strict: bool = False) -> str | None:
    """The reference answer of a label: its own boxed content when it has a box (read as `math` reads responses
    when `strict`); None for an empty label."""
    if label is None:
        return None
    ref = str(label)
    if strict:  # slime unwraps only a `\\boxed{...}` label (an `\\fbox` stays as written)
        ref = (strict_last_boxed(ref) or "") if "\\boxed" in ref else ref
    else:
        ref = last_boxed(ref) or ref
    return ref if ref.strip() else None


def _grade(pred: str | None, label: Any, strict: bool) -> float:
    ref = label_answer(label, strict=strict)
    if ref is None or pred is None:
        return 0.0
    return 1.0 if math_equal(pred, ref) else 0.0


def grade_math(response: str, label: Any, metadata: dict | None = None) -> float:
    """slime's `math`: 1.0 iff the content of the last `\\boxed{...}` of `response` equals `label`; else 0.0."""
    return _grade(strict_last_boxed(response), label, strict=True)


def grade_math_lenient(response: str, label: Any, metadata: dict | None = None) -> float:
    """1.0 iff the last boxed answer (or, with no box, the last number) of `response` equals `label`; else 0.0."""
    return _grade(extract_answer(response), label, strict=False)
