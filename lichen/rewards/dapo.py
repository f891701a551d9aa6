"""The `dapo` reward (DAPO-Math style): the answer is the text after the last `Answer:` in the response's last
300 characters (slime's window: the longest MATH-500 answer has 159 characters; an `Answer:` earlier than that
does not count).

Returns `{"score": +1.0 | -1.0, "acc": bool, "pred": str}`; train with `--reward-key score` (eval counts a
sample correct when its score is > 0). `pred` is the normalised answer ("" when the response has no `Answer:`).

Normalisation (applied to prediction and label alike), in order:
- the chat end markers `<|im_end|>` and `<|endoftext|>` go (a response decoded with its special tokens ends in
  one, e.g. `Answer: 42<|im_end|>`; slime's DAPO grader drops them too);
- a `\\boxed{...}` inside the answer is unwrapped;
- `$`, a trailing period and LaTeX spacing go; `\\text{...}`-style wrappers keep their content;
- a leading `x =` style assignment is dropped (`x = 5` -> `5`) when the left side is one short symbol;
- trailing unit words (cm, meters, dollars, degrees, …) and `^\\circ` / `\\%` marks are removed;
- `\\dfrac`/`\\tfrac` -> `\\frac`, `\\frac12` -> `\\frac{1}{2}`, `1,000` -> `1000`, whitespace removed.
Correct iff the normalised strings are equal, or both are numbers within 1e-6 relative tolerance.
"""

from __future__ import annotations

import re
from typing import Any

from lichen.rewards.rules import last_boxed, normalize_answer, parse_number

_ANSWER_LINE = re.compile(r"answer\s*:\s*([^\n]*)", re.IGNORECASE)
_ASSIGN = re.compile(r"^\s*[A-Za-z](?:_\{?\w+\}?)?\s*=\s*(?!=)")
_UNITS = (
    "degrees",
    "degree",
    "units",
    "unit",
    "dollars",
    "dollar",
    "cents",
    "cent",
    "meters",
    "meter",
    "cm",
    "mm",
    "km",
    "inches",
    "inch",
    "feet",
    "foot",
    "ft",
    "miles",
    "mile",
    "hours",
    "hour",
    "minutes",
    "minute",
    "seconds",
    "second",
    "sq",
    "square",
    "cubic",
    "mph",
    "pounds",
    "pound",
    "kg",
    "grams",
    "gram",
    "points",
    "point",
    "years",
    "year",
    "days",
    "day",
    "people",
    "students",
    "marbles",
)
_TRAILING_UNITS = re.compile(
    r"(?:\s*(?:\\text\{\s*|\\mbox\{\s*|\\mathrm\{\s*)?(?:" + "|".join(_UNITS) + r")\b\}?\.?)+\s*$", re.IGNORECASE
)
_FRAC_DIGITS = re.compile(r"\\frac(\d)(\d)")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
END_MARKERS = ("<|im_end|>", "<|endoftext|>")
ANSWER_WINDOW = 300  # characters at the end of the response searched for `Answer:`, as slime


def extract_dapo_answer(response: str) -> str | None:
    """The text after the last `Answer:` (to the end of its line), or None."""
    matches = _ANSWER_LINE.findall(response)
    return matches[-1].strip() if matches else None


def normalize_final_answer(answer: str) -> str:
    """The normalised form of a final answer (see the module docstring)."""
    s = answer
    for marker in END_MARKERS:
        s = s.replace(marker, "")
    s = s.strip()
    boxed = last_boxed(s)
    if boxed is not None:
        s = boxed
    s = s.strip().strip("$").strip()
    s = _ASSIGN.sub("", s, count=1)
    s = _TRAILING_UNITS.sub("", s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace("\\$", "")
    s = _FRAC_DIGITS.sub(r"\\frac{\1}{\2}", s)
    s = _THOUSANDS.sub("", s)
    return normalize_answer(s)


def dapo_equal(pred: str, ref: str) -> bool:
    a, b = normalize_final_answer(pred), normalize_final_answer(ref)
    if a == "" or b == "":
        return False
    if a == b:
        return True
    x, y = parse_number(a), parse_number(b)
    return x is not None and y is not None and abs(x - y) <= 1e-6 * max(1.0, abs(y))


def grade_dapo(response: str, label: Any, metadata: dict | None = None) -> dict:
    pred = extract_dapo_answer(response[-ANSWER_WINDOW:])
    ok = pred is not None and label is not None and dapo_equal(pred, str(label))
    return {"score": 1.0 if ok else -1.0, "acc": ok, "pred": normalize_final_answer(pred) if pred is not None else ""}
