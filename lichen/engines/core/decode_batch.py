"""Continuous batching over one KV cache: sequences join a running decode batch and leave it at any step.

Layout. All rows share one cache write position `cache.length` (so one decode step is one batched forward),
and each row's keys sit right-aligned before it: row j's valid key slots are `key_valid[j, :length]`. A row
that joins later is prefilled on its own (left-padded with the other newcomers) and copied in so that its
last prompt token lands on the slot before `length`; the slots before its first token are masked. When a
newcomer's prompt is longer than what the batch holds, the existing rows move right instead. Newcomers with
identical contexts (the n samples of one prompt) share one prefill row, copied to each of them. Rotary positions
come from each row's own position ids, so the slot a key sits in does not change its value.

Masked slots hold zeros, never uninitialised memory: a NaN there would survive the -inf mask (NaN * 0 = NaN).

Rebuilding the cache (on a join and on growth) copies its filled part once, about the cost of one decode step.
Finished rows leave in place instead, at the step they finish: the last live rows move into their slots, so a
drop copies one cache row per finished row (`_compact`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from lichen.engines.core.sampler import _M32, kept_sets, sample_rows, truncates
from lichen.models import CausalLM, KVCache

# Extra cache slots allocated per rebuild beyond the current length (grown again when used up): a long
# `max_new_tokens` does not reserve memory for tokens that are never generated.
GROW_SLOTS = 256


@dataclass
class Seq:
    """One sequence to generate (one prompt x one sample) and everything produced for it so far."""

    input_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0  # <= 0: greedy, log-probs read at T = 1
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 0
    stop_ids: frozenset[int] = frozenset()  # EOS (unless ignored) and stop_token_ids; the token is kept
    stop_strings: tuple[str, ...] = ()
    input_logprob_start: int = -1  # >= 0: also score the prompt tokens from this position on
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    # return the kept token set per position (top-p / top-k < full); the log-probs are then over that set
    return_sampling_mask: bool = False
    tag: Any = None  # the owner's handle (the server's job)

    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[list[tuple[float, int]]] = field(default_factory=list)
    output_ids_lp: list[list[tuple[float, int]]] = field(default_factory=list)
    output_kept: list[list[int]] = field(default_factory=list)  # per output token the kept ids (see truncates_sampling)
    input_logprobs: list[float | None] | None = None
    input_top: list[list[tuple[float, int]] | None] | None = None
    input_ids_lp: list[list[tuple[float, int]] | None] | None = None
    finish: tuple | None = None  # ("stop", token id | str) | ("length", n) | ("abort", message)
    versions: list[list] = field(default_factory=list)  # [version, start, end) spans over output tokens
    finish_version: str | None = None
    num_retractions: int = 0

    def append(self, token: int, logprob: float, version: str) -> None:
        self.output_ids.append(token)
        self.output_logprobs.append(logprob)
        n = len(self.output_ids)
        if self.versions and self.versions[-1][0] == version:
            self.versions[-1][2] = n
        else:
            self.versions.append([version, n - 1, n])

    @property
    def truncates_sampling(self) -> bool:
        """The request asked for its sampling mask and top-p / top-k remove tokens from the race (not greedy)."""
        return self.return_sampling_mask and self.temperature > 0 and truncates(self.top_p, self.top_k)

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.output_ids)


def stop_ids(ignore_eos: bool, eos_ids: Iterable[int], stop_token_ids: Iterable[int]) -> frozenset[int]:
    """The token ids that end a sequence. As in SGLang (Req.check_finished), `ignore_eos` turns off
    `stop_token_ids` too, not only EOS; stop strings still apply."""
    return frozenset() if ignore_eos else frozenset(eos_ids) | frozenset(stop_token_ids)


def context_error(prompt_tokens: int, max_new_tokens: int | None, context_length: int) -> str | None:
    """SGLang's message when a request does not fit, else None. SGLang's rule (TokenizerManager.
    _validate_one_request) leaves room below the context length: a prompt of `context_length` tokens, or prompt +
    max_new_tokens == context_length, is refused (`>=`, not `>`)."""
    n, ctx = prompt_tokens, context_length
    if n >= ctx:
        return f"The input ({n} tokens) is longer than the model's context length ({ctx} tokens)."
    if max_new_tokens is not None and n + max_new_tokens >= ctx:
        return (
            f"Requested token count exceeds the model's maximum context length of {ctx} tokens. You requested a "
            f"total of {n + max_new_tokens} tokens: {n} tokens from the input messages and {max_new_tokens} "
            "tokens for the completion. Please reduce the number of tokens in the input messages or the "
            "completion to fit within the limit."
        )
    return None


def left_padded(seqs: list[Seq], pad: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Each sequence's prompt + output so far, left-padded: (ids [B, P], valid [B, P], position ids, lengths)."""
    ctx = [s.input_ids + s.output_ids for s in seqs]
    lens = [len(c) for c in ctx]
    B, P = len(seqs), max(lens)
    ids = torch.full((B, P), pad, dtype=torch.long)
    valid = torch.zeros((B, P), dtype=torch.bool)
    for i, c in enumerate(ctx):
        ids[i, P - lens[i] :] = torch.tensor(c, dtype=torch.long)
        valid[i, P - lens[i] :] = True
    ids, valid = ids.to(device), valid.to(device)
    return ids, valid, (valid.long().cumsum(-1) - 1).clamp(min=0), lens


PROMPT_LOGPROB_CHUNK = 256  # prompt positions whose log-probs over the vocabulary are held at once


def _top(logp_row: torch.Tensor, k: int) -> list[tuple[float, int]]:
    vals, idx = torch.topk(logp_row, min(k, logp_row.shape[-1]))
    return list(zip(vals.tolist(), idx.tolist()))


def _picked(logp_row: torch.Tensor, ids: list[int]) -> list[tuple[float, int]]:
    return list(zip(logp_row[ids].tolist(), ids))


class DecodeBatch:
    """The running batch. `add` prefills newcomers and makes them part of the batch; `step` samples one token
    for every live row, finishes rows, and runs the next decode forward. Every live row always holds the
    logits of its next token between calls. Not thread-safe: one thread drives it.

    `stop_text(seq)` (optional) returns the stop string that the decoded output now ends with, or None.
    """

    def __init__(self, model: CausalLM, *, pad_token_id: int = 0, stop_text: Callable[[Seq], str | None] | None = None):
        self.model = model
        self.pad = pad_token_id
        self.stop_text = stop_text
        self._reset()

    def _reset(self) -> None:
        self.rows: list[Seq] = []
        self.cache: KVCache | None = None
        self.key_valid = self.next_pos = self.tokens = self.logits = None
        self.temp = self.top_p = self.top_k = self.seeds = None
        self.padded = False
        self.n_dead = 0

    def __len__(self) -> int:
        return len(self.rows) - self.n_dead

    def live(self) -> list[Seq]:
        return [s for s in self.rows if s.finish is None]

    @property
    def cache_tokens(self) -> int:
        return 0 if self.cache is None else len(self.rows) * self.cache.length

    # ---- joining ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def add(self, seqs: list[Seq], version: str) -> list[Seq]:
        """Prefill `seqs` (prompt + any output already generated, e.g. after a retract) and join them.

        Returns the ones already finished: no token budget left (scoring requests, `max_new_tokens` 0).
        """
        finished, todo = self._admit(seqs, version)
        if not todo:
            return finished
        p = next(self.model.parameters())
        dev, dtype = p.device, p.dtype
        # Samples of one prompt (n samples per prompt) join with identical contexts: prefill each distinct
        # context once and copy its cache rows to every sequence that has it (SGLang shares such prefixes
        # through its radix cache). Row `u` of the prefill serves todo[i] for every i with src[i] == u.
        distinct: dict[tuple[int, ...], int] = {}
        src = [distinct.setdefault(tuple(s.input_ids + s.output_ids), len(distinct)) for s in todo]
        first = {u: i for i, u in reversed(list(enumerate(src)))}
        ids, valid, pos, lens = left_padded([todo[first[u]] for u in range(len(distinct))], self.pad, dev)
        B, P = ids.shape
        mask = None
        if not bool(valid.all()):  # causal & real keys; a pad query may see itself so its softmax row is never empty
            causal = torch.ones((P, P), dtype=torch.bool, device=dev).tril()
            eye = torch.eye(P, dtype=torch.bool, device=dev)
            mask = ((causal[None] & valid[:, None, :]) | eye[None])[:, None]
        cache = KVCache(self.model.cfg, B, P, dev, dtype)
        hidden = self.model(ids, pos, cache=cache, attn_mask=mask)
        logits = self.model.logits(hidden[:, -1])
        for i, s in enumerate(todo):
            if s.input_logprob_start >= 0 and s.input_logprobs is None:
                u = src[i]
                self._score_prompt(s, hidden[u, P - lens[u] : P - lens[u] + len(s.input_ids)])
        keep = []
        for i, s in enumerate(todo):
            if s.remaining <= 0:
                self._finish(s, ("length", len(s.output_ids)), version)
                finished.append(s)
            else:
                keep.append(i)
        if keep:
            k = torch.tensor([src[i] for i in keep], dtype=torch.long, device=dev)
            part = {
                "rows": [todo[i] for i in keep],
                "k": [t.index_select(0, k) for t in cache.k],
                "v": [t.index_select(0, k) for t in cache.v],
                "valid": valid.index_select(0, k),
                "next_pos": pos[:, -1].index_select(0, k) + 1,
                "tokens": torch.zeros(len(keep), dtype=torch.long, device=dev),
                "logits": logits.index_select(0, k),
            }
            live = [j for j, s in enumerate(self.rows) if s.finish is None]
            self._rebuild([self._current_part(live), part] if live else [part])
        return finished

    def _admit(self, seqs: list[Seq], version: str) -> tuple[list[Seq], list[Seq]]:
        """(already finished: nothing to generate or score, to prefill)."""
        finished, todo = [], []
        for s in seqs:
            if not s.input_ids:
                raise ValueError("input_ids cannot be empty.")
            if s.remaining <= 0 and not (s.input_logprob_start >= 0 and s.input_logprobs is None):
                self._finish(s, ("length", len(s.output_ids)), version)
                finished.append(s)
            else:
                todo.append(s)
        return finished, todo

    def _score_prompt(self, s: Seq, h: torch.Tensor) -> None:
        """log p(prompt[j] | prompt[:j]) for j > start, under log_softmax(logits / T). Position `start` itself
        gets None, whatever `start` is: SGLang's first input log-prob is always null (docs/serve-protocol.md), so
        len(input_token_logprobs) == prompt_tokens - logprob_start_len."""
        start = s.input_logprob_start
        n = len(s.input_ids)
        first = start + 1
        vals: list[float | None] = [None] if start < n else []  # start == n: no prompt position to report
        tops: list = list(vals)
        picks: list = list(vals)
        t = s.temperature if s.temperature > 0 else 1.0
        # PROMPT_LOGPROB_CHUNK positions at a time: a long prompt's [positions, vocabulary] log-probs never exist
        # whole (8k positions at a 151,936-token vocabulary would be 5 GB, twice: logits and log_softmax)
        for lo in range(first, n, PROMPT_LOGPROB_CHUNK):
            hi = min(lo + PROMPT_LOGPROB_CHUNK, n)
            logp = torch.log_softmax(self.model.logits(h[lo - 1 : hi - 1]).float() / t, dim=-1)
            target = torch.tensor(s.input_ids[lo:hi], dtype=torch.long, device=logp.device)
            vals += logp.gather(-1, target[:, None]).squeeze(-1).tolist()
            for r in range(logp.shape[0]):
                if s.top_logprobs_num > 0:
                    tops.append(_top(logp[r], s.top_logprobs_num))
                if s.token_ids_logprob:
                    picks.append(_picked(logp[r], s.token_ids_logprob))
        s.input_logprobs = vals
        s.input_top = tops if s.top_logprobs_num > 0 else None
        s.input_ids_lp = picks if s.token_ids_logprob else None

    # ---- cache layout ---------------------------------------------------------------------------------------
    def _current_part(self, rows: list[int] | None = None) -> dict:
        """The batch (or the given row indices of it) as a part for `_rebuild`, trimmed to its filled slots."""
        L = self.cache.length
        idx = None if rows is None else torch.tensor(rows, dtype=torch.long, device=self.key_valid.device)

        def sel(t):
            return t if idx is None else t.index_select(0, idx)

        valid = sel(self.key_valid[:, :L])
        used = valid.any(0)
        start = int(used.long().argmax()) if bool(used.any()) else L
        return {
            "rows": self.rows if rows is None else [self.rows[j] for j in rows],
            "k": [sel(t[:, :, start:L]) for t in self.cache.k],
            "v": [sel(t[:, :, start:L]) for t in self.cache.v],
            "valid": valid[:, start:],
            "next_pos": sel(self.next_pos),
            "tokens": sel(self.tokens),
            "logits": sel(self.logits),
        }

    def _rebuild(self, parts: list[dict]) -> None:
        """Lay the parts out right-aligned in a fresh cache with room for GROW_SLOTS more decode steps."""
        rows = [s for p in parts for s in p["rows"]]
        if not rows:
            self._reset()
            return
        cfg = self.model.cfg
        L = max(p["valid"].shape[1] for p in parts)
        cap = L + max(1, min(GROW_SLOTS, max(s.remaining for s in rows)))
        dev = parts[0]["valid"].device
        dtype = parts[0]["k"][0].dtype
        B = len(rows)
        cache = KVCache.__new__(KVCache)
        shape = (B, cfg.num_kv_heads, cap, cfg.head_dim)
        # Uninitialised, not zeroed (zero-filling the whole cache was ~8% of W2's engine time): slots from L on
        # are written by the decode forward before attention reads them, and only the masked slots before each
        # part's keys are zeroed below (see the module docstring on NaN under the mask).
        cache.k = [torch.empty(shape, device=dev, dtype=dtype) for _ in range(cfg.num_layers)]
        cache.v = [torch.empty(shape, device=dev, dtype=dtype) for _ in range(cfg.num_layers)]
        cache.length = L
        key_valid = torch.ones((B, cap), dtype=torch.bool, device=dev)
        b = 0
        for p in parts:
            n, w = len(p["rows"]), p["valid"].shape[1]
            for layer in range(cfg.num_layers):
                cache.k[layer][b : b + n, :, : L - w] = 0
                cache.v[layer][b : b + n, :, : L - w] = 0
                cache.k[layer][b : b + n, :, L - w : L] = p["k"][layer]
                cache.v[layer][b : b + n, :, L - w : L] = p["v"][layer]
            key_valid[b : b + n, : L - w] = False
            key_valid[b : b + n, L - w : L] = p["valid"]
            b += n
        self.rows = rows
        self.cache, self.key_valid = cache, key_valid
        self.next_pos = torch.cat([p["next_pos"] for p in parts])
        self.tokens = torch.cat([p["tokens"] for p in parts])
        self.logits = torch.cat([p["logits"] for p in parts])
        self.temp = torch.tensor([s.temperature for s in rows], dtype=torch.float32, device=dev)
        self.top_p = torch.tensor([s.top_p for s in rows], dtype=torch.float32, device=dev)
        self.top_k = torch.tensor([s.top_k for s in rows], dtype=torch.long, device=dev)
        self.seeds = torch.tensor([s.seed & _M32 for s in rows], dtype=torch.int64, device=dev)
        self.padded = not bool(key_valid[:, :L].all())
        self.n_dead = sum(s.finish is not None for s in rows)

    def _compact(self) -> None:
        """Drop the finished rows in place (callers keep at least one live row): the last live rows move into
        their slots and every tensor is cut to the live count (and to the slots a live row uses). Only as many
        cache rows are copied as rows finished (a rebuild copied every row into a freshly allocated cache), so
        finished rows can leave at the very step they finish. Row order changes, which nothing depends on: a
        row's noise is keyed by its own seed and step (sampler.row_noise)."""
        n = len(self)
        holes = [j for j in range(n) if self.rows[j].finish is not None]
        movers = [j for j in range(n, len(self.rows)) if self.rows[j].finish is None]
        order = list(range(n))
        for h, m in zip(holes, movers):
            order[h] = m
        L = self.cache.length
        if holes:
            dev = self.key_valid.device
            dst = torch.tensor(holes, dtype=torch.long, device=dev)
            src = torch.tensor(movers, dtype=torch.long, device=dev)
            for t in self.cache.k + self.cache.v:  # holes < n <= movers: sources and targets never overlap
                filled = t[:, :, :L]
                filled.index_copy_(0, dst, filled.index_select(0, src))
        idx = torch.tensor(order, dtype=torch.long, device=self.key_valid.device)
        for name in ("key_valid", "next_pos", "tokens", "logits", "temp", "top_p", "top_k", "seeds"):
            setattr(self, name, getattr(self, name).index_select(0, idx))
        # Leading slots that only the dropped rows used (e.g. the longest prompt's) leave the view too, so
        # attention stops reading them: a view of the same storage, nothing is copied.
        used = self.key_valid[:, :L].any(0)
        start = int(used.long().argmax()) if bool(used.any()) else 0
        self.cache.k = [t[:n, :, start:] for t in self.cache.k]
        self.cache.v = [t[:n, :, start:] for t in self.cache.v]
        self.cache.length = L - start
        self.key_valid = self.key_valid[:, start:]
        self.rows = [self.rows[j] for j in order]
        self.padded = not bool(self.key_valid[:, : L - start].all())
        self.n_dead = 0

    # ---- stepping -----------------------------------------------------------------------------------------
    def _finish(self, s: Seq, reason: tuple, version: str) -> None:
        s.finish = reason
        s.finish_version = s.versions[-1][0] if s.versions else version

    @torch.no_grad()
    def step(self, version: str) -> list[Seq]:
        """Sample one token for every live row (tagged with `version`); return the rows that finished."""
        if not len(self):
            return []
        dev = self.logits.device
        steps = torch.tensor([len(s.output_ids) for s in self.rows], dtype=torch.int64, device=dev)
        tokens, lps, logp = sample_rows(self.logits, self.temp, self.top_p, self.top_k, self.seeds, steps)
        tok_list, lp_list = tokens.tolist(), lps.tolist()
        replay = [j for j, s in enumerate(self.rows) if s.finish is None and s.truncates_sampling]
        kept: dict[int, list[int]] = {}
        if replay:
            sel = torch.tensor(replay, device=dev)
            top_p, top_k = self.top_p, self.top_k
            assert top_p is not None and top_k is not None  # set with the rows (None only while empty)
            ids, renorm = kept_sets(logp[sel], top_p[sel], top_k[sel], tokens[sel])
            for j, row_ids, lp in zip(replay, ids, renorm):
                kept[j], lp_list[j] = row_ids, lp
        finished = []
        for j, s in enumerate(self.rows):
            if s.finish is not None:
                continue
            tok = tok_list[j]
            s.append(tok, lp_list[j], version)
            if j in kept:
                s.output_kept.append(kept[j])
            if s.top_logprobs_num > 0:
                s.output_top.append(_top(logp[j], s.top_logprobs_num))
            if s.token_ids_logprob:
                s.output_ids_lp.append(_picked(logp[j], s.token_ids_logprob))
            reason = None
            if tok in s.stop_ids:
                reason = ("stop", tok)
            elif s.stop_strings and self.stop_text is not None and (hit := self.stop_text(s)) is not None:
                reason = ("stop", hit)
            elif s.remaining <= 0:
                reason = ("length", len(s.output_ids))
            if reason is not None:
                self._finish(s, reason, version)
                finished.append(s)
        self.n_dead += len(finished)
        self.tokens = tokens
        self._advance()
        return finished

    def _advance(self) -> None:
        """Drop finished rows, then run the decode forward that gives every row its next logits."""
        if not len(self):
            self._reset()
            return
        if self.n_dead:  # cheap in place (see _compact): finished rows never take part in another forward
            self._compact()
        if self.cache.length >= self.cache.k[0].shape[2]:  # out of slots: rebuild with room for more
            self._rebuild([self._current_part()])
        L = self.cache.length
        step_mask = self.key_valid[:, None, None, : L + 1] if self.padded else None
        hidden = self.model(self.tokens[:, None], self.next_pos[:, None], cache=self.cache, attn_mask=step_mask)
        self.logits = self.model.logits(hidden[:, -1])
        self.next_pos = self.next_pos + 1

    def abort(self, seqs: list[Seq], message: str, version: str) -> None:
        """Finish the given live rows with ("abort", message); their partial output stays on them."""
        for s in seqs:
            if s.finish is None:
                self._finish(s, ("abort", message), version)
                self.n_dead += 1
        if not len(self):
            self._reset()
        elif self.n_dead:  # the same in-place drop as every step's (_advance)
            self._compact()

    def retract(self) -> list[Seq]:
        """Take every live row out (their cache is dropped); re-adding one recomputes its cache and continues."""
        live = self.live()
        for s in live:
            s.num_retractions += 1
        self._reset()
        return live
