"""The `gpqa` reward: multiple-choice letter extraction, 1.0 iff the chosen letter is the label's.

Letters and labels as slime's gpqa grader reads them:
- the letters: `metadata["valid_letters"]` when given, else A.. up to `len(metadata["choices"])` (or lichen's
  `metadata["num_choices"]`), else A-J;
- `metadata["choices"]` is a list of choice texts, or a dict from letter to text (`{"A": "red", "B": "blue"}`; keys
  that are not single letters count by position);
- the correct letter: `metadata["correct_letter"]`, else a one-letter label among the letters (`"b"` reads as B),
  else a numeric label as a 0-based index (`2`, `2.0`), else the choice whose text equals the label's once both
  are lower-cased with every run of non-alphanumerics made one space (`"Light-BLUE "` matches `"light blue"`).
The response (the part after its last `</think>`, if any; `*` markdown emphasis dropped) is searched in order:
1. the last boxed answer when it is one letter (`\\boxed{B}`, `\\boxed{\\text{(B)}}`);
2. the last statement "answer is B" / "answer: (B)" / "answer is option B";
3. the last "B is correct" / "(B) is the correct answer";
4. the last standalone choice letter (not part of a word; optionally in parentheses).
When both letters are known they decide. Otherwise, as slime: the response scores 1.0 when it contains the correct
choice's text, `metadata["correct_answer"]` / `["answer_text"]`, or a label that is not a letter (compared in the
folded form above, as whole words); or, with no correct letter, when the letter it picks is the label itself.
Else 0.0.
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Any

from lichen.rewards.deepscaler import after_thinking
from lichen.rewards.rules import last_boxed, normalize_answer

DEFAULT_CHOICES = 10  # A-J, slime's default


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
    valid = metadata.get("valid_letters")
    if valid:
        return "".join(str(letter).strip().upper() for letter in valid)
    n = metadata.get("num_choices")
    texts = _choice_texts(metadata)
    if n is None and texts:
        n = len(texts)
    n = int(n) if n else DEFAULT_CHOICES
    if not 2 <= n <= 26:
        raise ValueError(f"gpqa: {n} choices; expected between 2 and 26")
    return "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[:n]


def _fold(text: str) -> str:
    """A choice text compared as slime compares it: lower-case, every run of non-alphanumerics one space."""
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def label_letter(label: Any, metadata: dict | None) -> str | None:
    """The correct letter of a label (see the module docstring), or None when it names none."""
    metadata = metadata or {}
    letters = choice_letters(metadata)
    given = metadata.get("correct_letter")
    if isinstance(given, str) and given.strip():
        return given.strip().upper()
    if label is None or isinstance(label, bool):
        return None
    if isinstance(label, numbers.Real):
        if not math.isfinite(float(label)):
            return None
        index = int(label)  # as slime: int() of the number (2.0 -> C)
        return letters[index] if 0 <= index < len(letters) else None
    text = str(label).strip()
    if len(text) == 1 and text.upper() in letters:
        return text.upper()
    folded = [_fold(c) for c in _choice_texts(metadata) or []]
    if text and _fold(text) in folded:
        index = folded.index(_fold(text))
        return letters[index] if index < len(letters) else None
    return None


def _answer_texts(label: Any, letter: str | None, metadata: dict, letters: str) -> list[str]:
    """Texts whose presence in the response counts as the right answer when no letter can be compared."""
    texts = _choice_texts(metadata) or []
    out = []
    if letter is not None and letter in letters and letters.index(letter) < len(texts):
        out.append(texts[letters.index(letter)])
    out += [str(metadata[k]) for k in ("correct_answer", "answer_text") if metadata.get(k)]
    if isinstance(label, str) and label.strip() and not (len(label.strip()) == 1 and label.strip().upper() in letters):
        out.append(label.strip())
    return out


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
    metadata = metadata or {}
    letters = choice_letters(metadata)
    target = label_letter(label, metadata)
    picked = extract_choice(response, letters)
    if picked is not None and target is not None:
        return 1.0 if picked == target else 0.0
    answer = after_thinking(response)
    said = f" {_fold(response if answer is None else answer)} "
    if any(f" {_fold(t)} " in said for t in _answer_texts(label, target, metadata, letters) if _fold(t)):
        return 1.0
    if picked is not None and target is None and isinstance(label, str):
        return 1.0 if picked == label.strip().upper() else 0.0
    return 0.0
