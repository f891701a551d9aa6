"""The `gpqa` reward: multiple-choice letter extraction, 1.0 iff the chosen letter is the label's.

Choices are the letters A.. up to `len(metadata["choices"])` or `metadata["num_choices"]` (default A-D).
`metadata["choices"]` is a list of choice texts, or a dict from letter to text (`{"A": "red", "B": "blue"}`; keys
that are not single letters count by position). The label is a letter (`"B"`, `"(b)"`), a 0-based choice index
(an int, or a float with no fraction such as `2.0`, as JSON/parquet readers often give), or the text of one of
the choices, matched ignoring case and runs of whitespace (`"  Light  BLUE "` matches `"light blue"`).
The response (the part after its last `</think>`, if any; `*` markdown emphasis dropped) is searched in order:
1. the last boxed answer when it is one letter (`\\boxed{B}`, `\\boxed{\\text{(B)}}`);
2. the last statement "answer is B" / "answer: (B)" / "answer is option B";
3. the last "B is correct" / "(B) is the correct answer";
4. the last standalone choice letter (not part of a word; optionally in parentheses).
No letter found scores 0.0.
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Any

from lichen.rewards.deepscaler import after_thinking
from lichen.rewards.rules import last_boxed, normalize_answer


def _choice_texts(metadata: dict | None) -> list[str] | None:
    """The choice texts in letter order (a dict's letter keys sorted; other keys by position), or None."""
    choices = (metadata or {}).get("choices")
    if isinstance(choices, dict):
        keys = list(choices)
        if all(isinstance(k, str) and re.fullmatch(r"[A-Za-z]", k.strip()) for k in keys):
            keys.sort(key=lambda k: k.strip().upper())
        return [str(choices[k]) for k in keys]
    if isinstance(choices, (list, tuple)):
        return [str(c) for c in choices]
    return None


def choice_letters(metadata: dict | None) -> str:
    metadata = metadata or {}
    n = metadata.get("num_choices")
    texts = _choice_texts(metadata)
    if n is None and texts is not None:
        n = len(texts)
    n = int(n) if n else 4
    if not 2 <= n <= 26:
        raise ValueError(f"gpqa: {n} choices; expected between 2 and 26")
    return "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[:n]


def _fold(text: str) -> str:
    """Case- and whitespace-insensitive form of a choice text."""
    return " ".join(text.split()).casefold()


def label_letter(label: Any, metadata: dict | None) -> str | None:
    letters = choice_letters(metadata)
    if label is None or isinstance(label, bool):
        return None
    if isinstance(label, numbers.Real) and not isinstance(label, numbers.Integral):
        if not (math.isfinite(float(label)) and float(label).is_integer()):
            return None
        label = int(label)
    if isinstance(label, numbers.Integral):
        return letters[int(label)] if 0 <= label < len(letters) else None
    text = str(label).strip()
    m = re.fullmatch(r"\(?\s*([A-Za-z])\s*\)?\.?", text)
    if m and m.group(1).upper() in letters:
        return m.group(1).upper()
    folded = [_fold(c) for c in _choice_texts(metadata) or []]
    if _fold(text) in folded:
        index = folded.index(_fold(text))
        return letters[index] if index < len(letters) else None
    return None


def extract_choice(response: str, letters: str = "ABCD") -> str | None:
    answer = after_thinking(response)
    text = (response if answer is None else answer).replace("*", "")
    cls = f"[{letters}]"
    boxed = last_boxed(text)
    if boxed is not None:
        m = re.fullmatch(rf"\(?({cls})\)?", normalize_answer(boxed))
        if m:
            return m.group(1)
    patterns = (
        rf"(?i:answer)\s*(?:(?i:is)|:|=)?\s*(?:(?i:option|choice))?\s*:?\s*[\(\[]?({cls})(?![A-Za-z])",
        rf"(?<![A-Za-z])[\(\[]?({cls})[\)\]]?\s+is\s+(?:the\s+)?(?:correct|right)",
        rf"(?<![A-Za-z])[\(\[]?({cls})(?![A-Za-z])",
    )
    for pattern in patterns:
        found = re.findall(pattern, text)
        if found:
            return found[-1]
    return None


def grade_gpqa(response: str, label: Any, metadata: dict | None = None) -> float:
    target = label_letter(label, metadata)
    if target is None:
        raise ValueError(f"gpqa: label {label!r} is not a choice letter, index or choice text")
    return 1.0 if extract_choice(response, choice_letters(metadata)) == target else 0.0
