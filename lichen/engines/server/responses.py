"""`/generate` responses of `lichen serve`: the tokenizer guard, incremental detokenization, finish reasons, the
output JSON (text, ids, log-probs, weight-version spans) and abort status codes (requests:
lichen/engines/api/protocol.py)."""

from __future__ import annotations

import threading
import time
from itertools import accumulate
from typing import Any

from lichen.engines.api.protocol import Job, OutputOptions
from lichen.engines.core.decode_batch import Seq


class LockedTokenizer:
    """A tokenizer whose calls are serialised: the scheduler thread decodes (stop strings) while the event loop
    encodes, and a Hugging Face fast tokenizer can fail with "Already borrowed" when two threads use it at once."""

    def __init__(self, tokenizer: Any):
        self._tok = tokenizer
        self._lock = threading.Lock()

    def encode(self, *args, **kwargs):
        with self._lock:
            return self._tok.encode(*args, **kwargs)

    def decode(self, *args, **kwargs):
        with self._lock:
            return self._tok.decode(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        with self._lock:
            return self._tok.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


class Detok:
    """Decoding with a per-token cache (logprob triples decode every token on its own)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._cache: dict[tuple[int, bool], str] = {}

    def text(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special) if ids else ""

    def token(self, token_id: int, skip_special: bool = True) -> str:
        key = (token_id, skip_special)
        if key not in self._cache:
            self._cache[key] = self.tokenizer.decode([token_id], skip_special_tokens=skip_special)
        return self._cache[key]

    def stop_text(self, seq: Seq) -> str | None:
        """The stop string that the decoded output now contains (for the scheduler), else None."""
        width = max(len(s) for s in seq.stop_strings) + 8
        skip = getattr(seq.tag, "opts", OutputOptions()).skip_special_tokens
        tail = self.text(seq.output_ids[-width:], skip)
        for s in seq.stop_strings:
            if s in tail:
                return s
        return None


def finish_json(finish: tuple | None) -> dict | None:
    if finish is None:
        return None
    kind = finish[0]
    if kind == "stop":
        return {"type": "stop", "matched": finish[1]}
    if kind == "length":
        return {"type": "length", "length": finish[1]}
    return {
        "type": "abort",
        "message": finish[1],
        "status_code": finish[2] if len(finish) > 2 else None,
        "err_type": None,
    }


def output_text(job: Job, detok: Detok, n: int, final: bool) -> str:
    """Decoded output; at the end a matched stop token / string is cut off unless no_stop_trim."""
    seq, opts = job.seq, job.opts
    ids = seq.output_ids[:n]
    fin = seq.finish if final else None
    trim = fin is not None and fin[0] == "stop" and not opts.no_stop_trim
    if trim and isinstance(fin[1], int) and ids:
        ids = ids[:-1]
    text = detok.text(ids, opts.skip_special_tokens)
    if trim and isinstance(fin[1], str):
        at = text.find(fin[1])
        if at >= 0:
            text = text[:at]
    return text


def _triples(pairs, detok: Detok, with_text: bool, skip: bool) -> list:
    return [[lp, t, detok.token(t, skip) if with_text else None] for lp, t in pairs]


def version_spans(seq: Seq, n: int) -> list[dict]:
    spans = []
    for version, start, end in list(seq.versions):
        if start >= n:
            break
        spans.append({"version": version, "start": start, "end": min(end, n)})
    return spans


def generate_output(job: Job, detok: Detok, current_version: str, n: int | None = None) -> dict:
    """The /generate object for a job: final when `n` is None, else a stream snapshot of its first n tokens."""
    seq, opts = job.seq, job.opts
    final = n is None
    n = len(seq.output_ids) if final else n
    spans = version_spans(seq, n)
    version = (seq.finish_version if final and seq.finish_version else None) or (
        spans[-1]["version"] if spans else current_version
    )
    meta = {
        "id": job.rid,
        "finish_reason": finish_json(seq.finish) if final else None,
        "prompt_tokens": len(seq.input_ids),
        "completion_tokens": n,
        "cached_tokens": 0,
        "weight_version": version,
        "weight_versions": spans,
        "num_retractions": seq.num_retractions,
        "e2e_latency": time.time() - job.created,
    }
    if opts.return_logprob:
        w, skip = opts.return_text_in_logprobs, opts.skip_special_tokens
        out_pairs = list(zip(seq.output_logprobs[:n], seq.output_ids[:n]))
        meta["output_token_logprobs"] = _triples(out_pairs, detok, w, skip)
        if opts.logprob_start_len >= 0 and seq.input_logprobs is not None:
            ids = seq.input_ids[opts.logprob_start_len :]
            meta["input_token_logprobs"] = _triples(zip(seq.input_logprobs, ids), detok, w, skip)
        else:
            meta["input_token_logprobs"] = []
        if opts.top_logprobs_num > 0:
            meta["output_top_logprobs"] = [_triples(p, detok, w, skip) for p in seq.output_top[:n]]
            meta["input_top_logprobs"] = [
                None if p is None else _triples(p, detok, w, skip) for p in (seq.input_top or [])
            ]
        if opts.token_ids_logprob:
            meta["output_token_ids_logprobs"] = [_triples(p, detok, w, skip) for p in seq.output_ids_lp[:n]]
            meta["input_token_ids_logprobs"] = [
                None if p is None else _triples(p, detok, w, skip) for p in (seq.input_ids_lp or [])
            ]
    if seq.truncates_sampling:  # slime's ragged form: token k kept ids[offsets[k]:offsets[k + 1]] (sorted)
        kept = seq.output_kept[:n]
        meta["top_p_token_ids"] = [t for ids in kept for t in ids]
        meta["top_p_token_offsets"] = [0] + list(accumulate(len(ids) for ids in kept))
    return {"text": output_text(job, detok, n, final), "output_ids": list(seq.output_ids[:n]), "meta_info": meta}


def abort_status(job: Job) -> int | None:
    """An engine failure (abort with status 500/503) is an HTTP error, not a 200 with partial output."""
    f = job.seq.finish
    if f is not None and f[0] == "abort" and len(f) > 2 and f[2] in (500, 503):
        return f[2]
    return None
