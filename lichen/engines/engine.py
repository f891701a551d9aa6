"""The embedded generation engine: batched sampling over a preallocated KV cache.

`lichen serve` wraps this class; `--runtime local` uses it in process. It knows nothing about training: it takes
token ids and sampling parameters and returns token ids, log-probs and a finish reason, tagged with the weight
version it served.

Batching: prompts are left-padded so every row writes its next token at the same cache position. Finished
rows leave the batch (their cache rows are dropped) once enough of them have finished, so long, ragged answers
do not keep paying for the short ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch

from lichen.engines.sampling import sample_next
from lichen.models import CausalLM, KVCache, load_model


@dataclass
class GenRequest:
    input_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0  # <= 0: greedy
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int = 0
    ignore_eos: bool = False


@dataclass
class GenResult:
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str  # "stop" (EOS / stop token, which is included in output_ids) or "length"
    prompt_tokens: int
    weight_version: str


class Engine:
    """Generates for many requests at once with one model copy.

    `max_batch_size` caps how many sequences decode together (None: all requests of a call at once).
    """

    def __init__(
        self,
        model: CausalLM,
        *,
        eos_token_ids: Iterable[int],
        pad_token_id: int = 0,
        max_batch_size: int | None = None,
        weight_version: str = "0",
    ):
        self.model = model.eval()
        self.eos_token_ids = sorted(set(int(t) for t in eos_token_ids))
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.weight_version = weight_version
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    @classmethod
    def from_pretrained(cls, model_dir: str, *, device="cpu", dtype=torch.float32, **kwargs) -> "Engine":
        from lichen.models.tokenizer import eos_token_ids, load_tokenizer

        tok = load_tokenizer(model_dir)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        model = load_model(model_dir, device=device, dtype=dtype)
        return cls(model, eos_token_ids=eos_token_ids(tok, model_dir), pad_token_id=pad, **kwargs)

    # ---- weights ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights_from_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str) -> None:
        """Copy weights in place (the in-process transport: a direct tensor copy, cast to the engine dtype)."""
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"engine has no parameter {name!r}")
            params[name].copy_(tensor)
        self.weight_version = str(version)

    def offload(self) -> None:  # CPU: nothing to release (DESIGN §7)
        pass

    def onload(self, tags: list[str] | None = None) -> None:
        pass

    # ---- generation ---------------------------------------------------------------------------------------
    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        """Results are returned in request order. Requests are batched in order, `max_batch_size` at a time."""
        if not requests:
            return []
        size = self.max_batch_size or len(requests)
        results: list[GenResult] = []
        for start in range(0, len(requests), size):
            results.extend(self._generate_batch(requests[start : start + size]))
        return results

    @torch.no_grad()
    def _generate_batch(self, reqs: list[GenRequest]) -> list[GenResult]:
        dev = self.device
        B = len(reqs)
        lens = [len(r.input_ids) for r in reqs]
        if min(lens) == 0:
            raise ValueError("input_ids cannot be empty.")
        P = max(lens)
        max_new = [max(0, r.max_new_tokens) for r in reqs]
        out_ids: list[list[int]] = [[] for _ in reqs]
        out_lp: list[list[float]] = [[] for _ in reqs]
        reasons = ["length"] * B
        if max(max_new) == 0:
            return [GenResult([], [], "length", lens[i], self.weight_version) for i in range(B)]

        ids = torch.full((B, P), self.pad_token_id, dtype=torch.long)
        valid = torch.zeros((B, P), dtype=torch.bool)
        for i, r in enumerate(reqs):
            ids[i, P - lens[i] :] = torch.tensor(r.input_ids, dtype=torch.long)
            valid[i, P - lens[i] :] = True
        ids, valid = ids.to(dev), valid.to(dev)
        pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
        total = P + max(max_new)
        key_valid = torch.ones((B, total), dtype=torch.bool, device=dev)
        key_valid[:, :P] = valid
        padded = not bool(valid.all())

        temp = torch.tensor([r.temperature for r in reqs], dtype=torch.float32, device=dev)
        top_p = torch.tensor([r.top_p for r in reqs], dtype=torch.float32, device=dev)
        top_k = torch.tensor([r.top_k for r in reqs], dtype=torch.long, device=dev)
        seeds = torch.tensor([r.seed & 0xFFFFFFFF for r in reqs], dtype=torch.int64, device=dev)
        stop_sets = [set() if r.ignore_eos else set(self.eos_token_ids) for r in reqs]
        for s, r in zip(stop_sets, reqs):
            s.update(r.stop_token_ids)

        cache = KVCache(self.model.cfg, B, total, dev, self.dtype)
        mask = None
        if padded:  # causal & real keys; a pad query may see itself so its softmax row is never empty
            causal = torch.ones((P, P), dtype=torch.bool, device=dev).tril()
            eye = torch.eye(P, dtype=torch.bool, device=dev)
            mask = (causal[None] & valid[:, None, :]) | eye[None]
            mask = mask[:, None]
        hidden = self.model(ids, pos, cache=cache, attn_mask=mask)
        logits = self.model.logits(hidden[:, -1])
        next_pos = pos[:, -1] + 1

        rows = list(range(B))  # rows[j] = request index of batch row j
        done = [m == 0 for m in max_new]
        n_done_in_batch = sum(done)
        for step in range(max(max_new)):
            tokens, lps = sample_next(logits, temp, top_p, top_k, seeds, step)
            tok_list, lp_list = tokens.tolist(), lps.tolist()
            for j, i in enumerate(rows):
                if done[i]:
                    continue
                out_ids[i].append(tok_list[j])
                out_lp[i].append(lp_list[j])
                if tok_list[j] in stop_sets[i]:
                    done[i], reasons[i] = True, "stop"
                elif len(out_ids[i]) >= max_new[i]:
                    done[i] = True
                if done[i]:
                    n_done_in_batch += 1
            if n_done_in_batch == len(rows):
                break
            # Drop finished rows once they are at least 1/8 of the batch: a row copy of the cache costs about
            # as much as a decode step, so compacting on every single finish would cost more than it saves.
            if n_done_in_batch and n_done_in_batch * 8 >= len(rows):
                keep = [j for j, i in enumerate(rows) if not done[i]]
                keep_t = torch.tensor(keep, dtype=torch.long, device=dev)
                rows = [rows[j] for j in keep]
                cache.keep_rows(keep_t)
                tokens, next_pos, key_valid = tokens[keep_t], next_pos[keep_t], key_valid[keep_t]
                temp, top_p, top_k, seeds = temp[keep_t], top_p[keep_t], top_k[keep_t], seeds[keep_t]
                n_done_in_batch = 0
            L = cache.length + 1
            step_mask = key_valid[:, None, None, :L] if padded else None
            hidden = self.model(tokens[:, None], next_pos[:, None], cache=cache, attn_mask=step_mask)
            logits = self.model.logits(hidden[:, -1])
            next_pos = next_pos + 1
        return [GenResult(out_ids[i], out_lp[i], reasons[i], lens[i], self.weight_version) for i in range(B)]
