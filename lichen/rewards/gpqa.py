"""The `gpqa` reward: multiple-choice letter extraction, 1.0 iff the chosen letter is the label's.

Choices are the letters A.. up to `len(metadata["choices"])` or `metadata["num_choices"]` (default A-D). The
label is a letter (`"B"`, `"(b)"`), a 0-based choice index, or the text of one of `metadata["choices"]`.
The response (the part after its last `</think>`, if any; `*` markdown emphasis dropped) is searched in order:
1. the last boxed answer when it is one letter (`\\boxed{B}`, `\\boxed{\\text{(B)}}`);
2. the last statement "answer is B" / "answer: (B)" / "answer is option B";
3. the last "B is correct" / "(B) is the correct answer";
4. the last standalone choice letter (not part of a word; optionally in parentheses).
No letter found scores 0.0.
"""

from __future__ import annotations

import re
from typing import Any

from lichen.rewards.deepscaler import after_thinking
from lichen.rewards.rules import last_boxed, normalize_answer


def choice_letters(metadata: dict | None) -> str:
    metadata = metadata or {}
    n = metadata.get("num_choices")
    if n is None and isinstance(metadata.get("choices"), (list, tuple)):
        n = len(metadata["choices"])
    n = int(n) if n else 4
    if not 2 <= n <= 26:
        raise ValueError(f"gpqa: {n} choices; expected between 2 and 26")
    return "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[:n]


def label_letter(label: Any, metadata: dict | None) -> str | None:
    letters = choice_letters(metadata)
    if label is None:
        return None
    if isinstance(label, int) and not isinstance(label, bool):
        return letters[label] if 0 <= label < len(letters) else None
    text = str(label).strip()
    m = re.fullmatch(r"\(?\s*([A-Za-z])\s*\)?\.?", text)
    if m and m.group(1).upper() in letters:
        return m.group(1).upper()
    choices = (metadata or {}).get("choices")
    if isinstance(choices, (list, tuple)) and text in [str(c).strip() for c in choices]:
        return letters[[str(c).strip() for c in choices].index(text)]
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
