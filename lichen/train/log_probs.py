"""Per-token log-probs of a model on micro-batches: the training forward and the no-grad passes of a step.

log pi(token) = log_softmax(logits / T)[token] at each response position (docs/architecture.md#log-prob-convention)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from lichen import algo
from lichen.train.micro_batches import MicroBatch, Plan, StepBatch


@dataclass(frozen=True)
class LogProbs:
    device: torch.device
    temperature: float  # the sampling temperature: log-probs are of the distribution tokens were drawn from
    bf16: bool  # forward under bfloat16 autocast (the weights stay fp32)

    def autocast(self):
        if self.bf16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward(self, model, mb: MicroBatch, need_entropy: bool = False):
        """([b, R] log-probs of the response tokens, [b, R] entropy or None)."""
        with self.autocast():
            hidden = model(mb.input_ids, mb.position_ids, attn_mask=mb.attn_mask)
            logits = model.logits(mb.response_hidden(hidden))
        # at least fp32 (bf16 autocast gives bf16 logits); a float64 model keeps float64 (exactness tests)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / self.temperature
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, mb.resp_tokens[..., None]).squeeze(-1)
        entropy = algo.entropy_from_logits(logits) if need_entropy else None
        return logp, entropy

    @torch.no_grad()
    def of_batch(self, model, batch: StepBatch, plans: list[Plan], width: int) -> torch.Tensor:
        """[n, width] log-probs of every sample of `batch` (0 on padding), one no-grad forward per plan; fp32,
        or float64 for a float64 model (its log-probs stay exact)."""
        out = None
        for plan in plans:
            mb = batch.micro(plan, self.device)
            lp, _ = self.forward(model, mb)
            if out is None:
                out = torch.zeros((len(batch.samples), width), device=self.device, dtype=lp.dtype)
            out[mb.indices, : lp.shape[1]] = lp
        return out if out is not None else torch.zeros((len(batch.samples), width), device=self.device)
