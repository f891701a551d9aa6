"""The `f1` reward: token-level F1 between the response and the label after SQuAD normalisation.

normalize(s) = lower-case, drop ASCII punctuation, drop the articles a / an / the, collapse whitespace.
With P = prediction tokens and G = gold tokens (multisets), overlap = |P ∩ G| (counted with multiplicity):
    precision = overlap / |P|,  recall = overlap / |G|,  F1 = 2 * precision * recall / (precision + recall)
and F1 = 0 when overlap = 0; when either side normalises to no tokens, F1 = 1.0 iff both do.
A list label holds alternative gold answers: the best F1 counts. A reasoning response is graded on the text
after its last `</think>`; an empty or missing label scores 0.0.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any

from lichen.rewards.deepscaler import after_thinking

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_squad(text: str) -> str:
    text = text.lower().translate(_PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def token_f1(prediction: str, gold: str) -> float:
    pred_tokens = normalize_squad(prediction).split()
    gold_tokens = normalize_squad(gold).split()
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    overlap = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(pred_tokens)
    recall = overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def grade_f1(response: str, label: Any, metadata: dict | None = None) -> float:
    golds = label if isinstance(label, (list, tuple)) else [label]
    golds = [str(g) for g in golds if g is not None and str(g).strip()]
    if not golds:
        return 0.0
    answer = after_thinking(response)
    text = response if answer is None else answer
    return max(token_f1(text, g) for g in golds)
