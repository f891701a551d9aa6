"""Decoding on the generic HF path (lichen.models.hf_model): the module's forward with transformers' KV cache.

lichen's own DecodeBatch lays every row out in one preallocated KV cache and moves rows in and out of it; an HF
module's cache (DynamicCache, or a model's own class such as Qwen3-Next's linear-attention state) has no such
layout lichen could rearrange for every architecture. So this batch rebuilds instead: when sequences join, or once
an eighth of the rows have finished, every live row is prefilled again from its prompt and the tokens it has
generated so far (left-padded, with an attention mask and each row's own position ids), and decoding continues
from that fresh cache. Between rebuilds one decode step is one batched forward, as in lichen's engine. Sampling,
stop rules, log-probs and prompt scoring are DecodeBatch's own, so both engines produce the same fields.
"""

from __future__ import annotations

import torch

from lichen.engines.core.decode_batch import DecodeBatch, Seq, left_padded
from lichen.engines.core.sampler import _M32


class HFDecodeBatch(DecodeBatch):
    """DecodeBatch over an HFCausalLM (see the module docstring)."""

    def _reset(self) -> None:
        super()._reset()
        self.past = None
        self.keys: torch.Tensor | None = None  # [B, L] True on real keys (prompts are left-padded)

    @property
    def cache_tokens(self) -> int:
        return 0 if self.keys is None else int(self.keys.numel())

    @torch.no_grad()
    def add(self, seqs: list[Seq], version: str) -> list[Seq]:
        finished, todo = self._admit(seqs, version)
        if not todo:
            return finished
        self._prefill(self.live() + todo, version)
        for s in todo:
            if s.finish is not None:
                finished.append(s)
        return finished

    def _prefill(self, rows: list[Seq], version: str) -> None:
        """A fresh cache and next-token logits for `rows` (prompt + output so far); prompt scoring where asked."""
        if not rows:
            self._reset()
            return
        dev = next(self.model.parameters()).device
        ids, keys, pos, lens = left_padded(rows, self.pad, dev)
        B, P = ids.shape
        hidden, past = self.model.decode(ids, pos, keys.long(), None)
        for i, s in enumerate(rows):
            if s.input_logprob_start >= 0 and s.input_logprobs is None:
                self._score_prompt(s, hidden[i, P - lens[i] : P - lens[i] + len(s.input_ids)])
        for s in rows:
            if s.remaining <= 0:  # a scoring request: nothing to generate
                self._finish(s, ("length", len(s.output_ids)), version)
        self.rows, self.past, self.keys = rows, past, keys
        self.next_pos = pos[:, -1] + 1
        self.tokens = torch.zeros(B, dtype=torch.long, device=dev)
        self.logits = self.model.logits(hidden[:, -1])
        self.temp = torch.tensor([s.temperature for s in rows], dtype=torch.float32, device=dev)
        self.top_p = torch.tensor([s.top_p for s in rows], dtype=torch.float32, device=dev)
        self.top_k = torch.tensor([s.top_k for s in rows], dtype=torch.long, device=dev)
        self.seeds = torch.tensor([s.seed & _M32 for s in rows], dtype=torch.int64, device=dev)
        self.n_dead = sum(s.finish is not None for s in rows)
        if not len(self):
            self._reset()

    def _compact(self) -> None:
        self._prefill(self.live(), "")

    def _advance(self) -> None:
        if not len(self):
            self._reset()
            return
        if self.n_dead and self.n_dead * 8 >= len(self.rows):
            self._compact()  # the rebuild gives every live row its next logits
            return
        self.keys = torch.cat([self.keys, torch.ones_like(self.keys[:, :1])], dim=1)
        hidden, self.past = self.model.decode(self.tokens[:, None], self.next_pos[:, None], self.keys.long(), self.past)
        self.logits = self.model.logits(hidden[:, -1])
        self.next_pos = self.next_pos + 1
