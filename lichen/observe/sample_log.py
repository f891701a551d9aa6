"""`--log-samples N`: a few samples of every step, with their tokens, for `lichen report`'s sample browser.

Each step writes `<output_dir>/samples/step_<NNNNNN>.jsonl.gz` (gzip JSON Lines, written to a temporary name and
renamed, so a reader never sees half a file): at most N samples, whole prompt groups first (a group shows its
reward contrast), one JSON object each:

    step, group_index, index, prompt, response, label, reward (float; the dict as `reward_detail`), status,
    weight_versions, engine (the engine server's URL; a list, one per engine call, for a sample made by several
    calls: the turns of a multi-turn rollout, resumed partial segments; absent for the in-process engine), prompt_length, response_length, tokens (the response
    token ids), token_texts (decoded one by one, when a tokenizer is at hand), rollout_log_probs,
    trainer_log_probs, advantages (per response token, where the step computed them), reward_error

Texts are cut at MAX_TEXT characters, so a step's file stays small whatever the responses hold.
"""

from __future__ import annotations

import gzip
import json
import math
import os
from typing import Any, Callable, Sequence

from lichen.types import Sample

SAMPLES_DIR = "samples"
MAX_TEXT = 4000


def step_path(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, SAMPLES_DIR, f"step_{step:06d}.jsonl.gz")


def pick(groups: Sequence[Sequence[Sample]], n: int) -> list[Sample]:
    """The first `n` samples taking whole groups in order (the last group may be cut)."""
    out: list[Sample] = []
    for group in groups:
        for s in group:
            if len(out) >= n:
                return out
            out.append(s)
    return out


def _cut(text: Any) -> Any:
    if isinstance(text, str) and len(text) > MAX_TEXT:
        return text[:MAX_TEXT] + f"... [{len(text) - MAX_TEXT} more characters]"
    if isinstance(text, list):  # chat messages
        return [{**m, "content": _cut(m.get("content"))} if isinstance(m, dict) else _cut(m) for m in text]
    return text


def _floats(values: Any) -> list[float | None] | None:
    if values is None:
        return None
    return [round(float(v), 5) if math.isfinite(float(v)) else None for v in values]


def sample_record(
    s: Sample,
    step: int,
    *,
    reward_key: str | None = None,
    decode: Callable[[list[int]], str] | None = None,
    trainer_log_probs: Sequence[float] | None = None,
    advantages: Sequence[float] | None = None,
) -> dict:
    """One line of the sample log (see the module docstring)."""
    try:
        reward: float | None = s.scalar_reward(reward_key)
    except (KeyError, TypeError, ValueError):
        reward = None
    meta = s.metadata or {}
    tokens = list(s.response_tokens)
    rec: dict[str, Any] = {
        "step": step,
        "group_index": s.group_index,
        "index": s.index,
        "prompt": _cut(s.prompt),
        "response": _cut(s.response),
        "label": _cut(s.label if isinstance(s.label, (str, int, float)) else json.dumps(s.label, default=str)),
        "reward": reward if reward is None or math.isfinite(reward) else None,
        "status": getattr(s.status, "value", str(s.status)),
        "weight_versions": list(s.weight_versions),
        "prompt_length": s.prompt_length,
        "response_length": s.response_length,
        "tokens": tokens,
        "rollout_log_probs": _floats(s.rollout_log_probs),
        "trainer_log_probs": _floats(trainer_log_probs),
        "advantages": _floats(advantages),
    }
    if isinstance(s.reward, dict):
        rec["reward_detail"] = json.loads(json.dumps(s.reward, default=str))
    if "engine" in meta:  # a server URL, or one per engine call (turns of a multi-turn sample, resumed segments)
        engine = meta["engine"]
        rec["engine"] = [str(e) for e in engine] if isinstance(engine, (list, tuple)) else str(engine)
    if "reward_error" in meta:
        rec["reward_error"] = _cut(str(meta["reward_error"]))
    if decode is not None and tokens:
        try:
            rec["token_texts"] = [decode([t]) for t in tokens]
        except Exception:  # a tokenizer that cannot decode one id alone: the browser shows the ids
            pass
    return rec


class SampleLog:
    """Writes each step's file; `n` = 0 writes nothing."""

    def __init__(
        self,
        output_dir: str,
        n: int,
        *,
        reward_key: str | None = None,
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.output_dir, self.n, self.reward_key, self.decode = output_dir, n, reward_key, decode

    def write(
        self,
        step: int,
        groups: Sequence[Sequence[Sample]],
        token_values: Callable[[list[int]], dict] | dict | None = None,
    ) -> str | None:
        """Log step `step`'s samples. `token_values` gives "trainer_log_probs"/"advantages" per-token values: the
        trainer's `token_values(rows)` (lichen.train.trainer_protocol: one row per requested index of the flattened
        batch, asked only for the logged samples), or a dict of [n, R] tensors / lists indexed like the flattened
        batch; None (or a value None): not computed."""
        if self.n <= 0:
            return None
        flat_index = {id(s): i for i, s in enumerate(s for g in groups for s in g)}
        picked = pick(groups, self.n)
        wanted = [flat_index[id(s)] for s in picked]
        if callable(token_values):
            values = token_values(wanted) or {}
        else:
            values = {k: None if v is None else [v[i] for i in wanted] for k, v in (token_values or {}).items()}
        records = []
        for j, s in enumerate(picked):
            rows = {k: _row(v, j, s.response_length) for k, v in values.items()}
            records.append(sample_record(s, step, reward_key=self.reward_key, decode=self.decode, **rows))
        path = step_path(self.output_dir, step)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = path + ".tmp"
        with gzip.open(tmp, "wt", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec, allow_nan=False, default=str) + "\n")
        os.replace(tmp, path)
        return path


def _row(values: Any, i: int, length: int) -> list[float] | None:
    """Row `i` of a [n, R] tensor or list of rows, cut to the response length."""
    if values is None:
        return None
    row = values[i]
    row = row.tolist() if hasattr(row, "tolist") else list(row)
    return row[:length]


def read_samples(output_dir: str) -> list[dict]:
    """Every logged sample of a run directory, in step order; a file being written (or broken) is skipped."""
    folder = os.path.join(output_dir, SAMPLES_DIR)
    if not os.path.isdir(folder):
        return []
    out: list[dict] = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".jsonl.gz"):
            continue
        try:
            with gzip.open(os.path.join(folder, name), "rt", encoding="utf-8") as f:
                out += [json.loads(line) for line in f if line.strip()]
        except (OSError, EOFError, ValueError, RecursionError):  # ValueError: bad JSON, bytes that are not UTF-8
            continue
    return out
