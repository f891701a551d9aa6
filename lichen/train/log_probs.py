"""Per-token log-probs of a model on micro-batches: the training forward and the no-grad passes of a step.

log pi(token) = log_softmax(logits / T)[token] at each response position (docs/architecture.md#log-prob-convention),
the logits outside the position's kept set masked to -inf first where the rollout recorded one (top-p / top-k:
sampling-mask replay, lichen.train.sampling_mask), for the policy and the reference model alike.

By default (--log-probs-chunk-size N >= 1) the log-probs and the entropy are computed from the final hidden states
and the LM head in chunks of N positions (lichen.train.chunked_logprobs): the [positions, vocabulary] logits and
their gradient never exist whole. With N <= 0, or a model that exposes no `lm_head_weight`, the full logits are
computed at once through `model.logits`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from lichen.train.chunked_logprobs import LMHead, chunked_token_log_probs, log_probs_from_logits
from lichen.train.micro_batches import MicroBatch, Plan, StepBatch


@dataclass(frozen=True)
class LogProbs:
    device: torch.device
    temperature: float  # the sampling temperature: log-probs are of the distribution tokens were drawn from
    bf16: bool  # forward under bfloat16 autocast (the weights stay fp32)
    chunk_size: int = 512  # --log-probs-chunk-size: positions of logits at once; <= 0 the full logits

    def autocast(self):
        if self.bf16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward(self, model, mb: MicroBatch, need_entropy: bool = False):
        """([b, R] log-probs of the response tokens, [b, R] entropy or None)."""
        with self.autocast():
            hidden = mb.response_hidden(model(mb.input_ids, mb.position_ids, attn_mask=mb.attn_mask))
            if self.chunk_size >= 1 and hasattr(model, "lm_head_weight"):
                b, r = mb.resp_tokens.shape
                logp, entropy = chunked_token_log_probs(
                    hidden.reshape(b * r, -1),
                    LMHead.of(model),
                    mb.resp_tokens.reshape(-1),
                    temperature=self.temperature,
                    need_entropy=need_entropy,
                    chunk_size=self.chunk_size,
                    keep=mb.keep,
                )
                return logp.view(b, r), (None if entropy is None else entropy.view(b, r))
            logits = model.logits(hidden)
        # at least fp32 (bf16 autocast gives bf16 logits); a float64 model keeps float64 (exactness tests)
        return log_probs_from_logits(
            logits, mb.resp_tokens, temperature=self.temperature, need_entropy=need_entropy, keep=mb.keep
        )

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
