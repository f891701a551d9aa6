"""Rule rewards chosen by `--rm-type`: plain functions `fn(response: str, label, metadata: dict) -> float | dict`.

- `exact`: 1.0 iff response.strip() == str(label).strip().
- `leading_number`: 1.0 iff the integer at the start of the response (after optional whitespace: an optional '-'
  then digits, stopping at the first non-digit) equals int(label). The quick-start addition task: prompt
  "12+35=", response "47<eos>".

The string helpers below (boxed-answer extraction, normalisation, number parsing) are shared by the graders in
`math_grader`, `dapo`, `deepscaler`, `f1` and `gpqa`; the registry of every rm type lives in `hub`.
"""

from __future__ import annotations

import re
from typing import Any, Callable

RuleFn = Callable[[str, Any, dict], "float | dict"]  # (response, label, metadata) -> reward


def exact(response: str, label: Any, metadata: dict | None = None) -> float:
    if label is None:
        return 0.0
    return 1.0 if response.strip() == str(label).strip() else 0.0


_LEADING_INT = re.compile(r"\s*(-?\d+)")


def leading_number(response: str, label: Any, metadata: dict | None = None) -> float:
    try:
        target = int(label)
    except (TypeError, ValueError):
        raise ValueError(f"leading_number: label {label!r} is not an integer") from None
    m = _LEADING_INT.match(response)
    return 1.0 if m is not None and int(m.group(1)) == target else 0.0


# ---------------------------------------------------------------------------------------------------- math


_BOX_CMD = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` whose braces balance; `\\boxed 5` also counts. Only when there is
    no usable `\\boxed` is the last `\\fbox{...}` taken."""
    for command in ("boxed", "fbox"):
        found = _last_box_of(text, command)
        if found is not None:
            return found
    return None


def _last_box_of(text: str, command: str) -> str | None:
    # (?![A-Za-z]) so that a longer command such as \boxedsomething is not read as \boxed
    starts = [m.end() for m in re.finditer(r"\\" + command + r"(?![A-Za-z])", text)]
    for pos in reversed(starts):
        while pos < len(text) and text[pos] == " ":
            pos += 1
        if pos < len(text) and text[pos] == "{":
            depth = 0
            for j in range(pos, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[pos + 1 : j]
            continue  # unbalanced: try the box before it
        m = re.match(r"[^\s$]+", text[pos:])
        if m:
            return m.group(0)
    return None


def strict_last_boxed(text: str) -> str | None:
    """The answer of the last `\\boxed` only, as slime's math graders read it: that occurrence must be the braced
    form `\\boxed{...}` with balanced braces, else there is no answer (no look-back to an earlier box, no
    `\\boxed 5`, no `\\fbox`)."""
    start = text.rfind("\\boxed")
    if start < 0 or not text.startswith("{", start + len("\\boxed")):
        return None
    open_at = start + len("\\boxed")
    depth = 0
    for j in range(open_at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[open_at + 1 : j]
    return None


# "1,000" as one number (thousands separators) before the plain form, so "(1,2)" still reads as 1 and 2
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:/\d+)?")


def extract_answer(text: str) -> str | None:
    """The last balanced boxed answer; a text with no box at all falls back to its last number.

    A text that has `\\boxed` but no balanced box (e.g. cut off mid-answer) yields None: the model tried to box
    an answer and failed, so a stray number elsewhere must not earn credit.
    """
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if _BOX_CMD.search(text):
        return None
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


_TEXT_CMD = re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox)\{([^{}]*)\}")
_DEGREES = re.compile(r"\^\s*\{?\\circ\}?|°|\\degree")
_LEADING_DOT = re.compile(r"(?<![\d.])\.(\d)")


def normalize_answer(s: str) -> str:
    """Light, meaning-preserving clean-up before comparison.

    Drops `\\left`/`\\right`, `\\text{}`-style wrappers (keeping their content), `$`, LaTeX spacing, degree
    marks and whitespace; `\\dfrac`/`\\tfrac` become `\\frac`; a leading-dot decimal gains its zero (`.5` ->
    `0.5`); a trailing period goes.
    """
    s = s.replace("\\left", "").replace("\\right", "")
    s = _TEXT_CMD.sub(r"\1", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _DEGREES.sub("", s)
    for spacing in ("\\!", "\\,", "\\;", "\\:", "\\ "):
        s = s.replace(spacing, "")
    s = s.replace("$", "")
    s = re.sub(r"\s+", "", s)
    s = _LEADING_DOT.sub(r"0.\1", s)
    return s.rstrip(".")


_PLAIN = re.compile(r"^-?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?$")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_FRAC = re.compile(r"^(-?)\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}$")
_FRAC_SHORT = re.compile(r"^(-?)\\frac(\d)(\d)$")
_SLASH = re.compile(r"^(-?[\d.]+)/(-?[\d.]+)$")


def parse_number(s: str) -> float | None:
    """A normalised answer as a float: plain decimals, 1,000, \\frac{a}{b}, \\frac12, a/b; else None."""
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    try:
        if _PLAIN.match(s):
            return float(s)
        m = _FRAC.match(s) or _FRAC_SHORT.match(s)
        if m:
            num, den = float(m.group(2)), float(m.group(3))
            return None if den == 0 else (-1 if m.group(1) else 1) * num / den
        m = _SLASH.match(s)
        if m:
            num, den = float(m.group(1)), float(m.group(2))
            return None if den == 0 else num / den
    except ValueError:  # "1.2.3" passes the loose digit classes above
        return None
    return None


def answers_equal(pred: str, ref: str) -> bool:
    a, b = normalize_answer(pred), normalize_answer(ref)
    if a == b:
        return True
    x, y = parse_number(a), parse_number(b)
    return x is not None and y is not None and abs(x - y) <= 1e-6 * max(1.0, abs(y))
