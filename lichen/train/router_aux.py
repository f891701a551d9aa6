"""--moe-aux-loss-coeff: the MoE router's load-balancing loss as a term of the training loss.

The loss is the transformers module's own `load_balancing_loss_func` (HFCausalLM.router_aux_loss), the
Switch-Transformer loss over every MoE layer's router logits pooled together, padding excluded:

    aux(tokens) = E * sum_e f_e * P_e,   f_e = (top-k assignments to expert e) / n,   P_e = mean router prob of e

with E experts, k routed per token and n = (real tokens) x (MoE layers) (so sum_e f_e = k; a perfectly balanced
router gives aux = k).

Micro-batches. `aux` is not a sum over tokens, so it cannot be split exactly: each micro-batch m computes aux over
its own tokens, weighted by its share of the step's tokens,

    loss_m += coeff * aux(tokens of m) * n_m / N,   N = sum over the optimizer step's trained micro-batches of n_m,

(n_m: the real input tokens of m), so the step adds coeff times the token-weighted mean of the micro-batches' aux
(exactly the module's own `router_aux_loss_coef * aux_loss` when the step is one micro-batch) and
`train/moe_aux_loss` reports that mean without the coefficient. Every rank of the multi-rank trainer computes the
same N from the step's plan, so the ranks' summed gradients are the single-rank trainer's. With the term on, no
sample's loss share is zero, so the zero-advantage skip is off (lichen.train.actor).

Models without such a loss (dense models, lichen's own implementations, MoE types balanced by a bias instead of a
loss) add nothing; a coefficient > 0 is then logged as ignored, as Megatron ignores it for a dense model.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from lichen.observe.metrics import get_logger
from lichen.train.micro_batches import Plan, row_width

log = get_logger(__name__)


class RouterAuxLoss:
    """The load-balancing term of one policy model; `active` when the coefficient is > 0 and the model has one."""

    def __init__(self, model: nn.Module, coeff: float):
        self.coeff = coeff
        has_loss = getattr(model, "load_balancing_loss_fn", None) is not None
        self.active = coeff > 0 and has_loss
        if coeff > 0 and not has_loss:
            kind = getattr(getattr(model, "cfg", None), "model_type", type(model).__name__)
            log.warning(
                "--moe-aux-loss-coeff %g is ignored: model_type %s has no router load-balancing loss (a dense "
                "model, or MoE routing balanced without one; docs/models.md#moe)",
                coeff,
                kind,
            )

    def recording(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Around the training forward: the model keeps its router logits (nothing when inactive)."""
        return model.recording_router_logits() if self.active else contextlib.nullcontext()

    def share(
        self, model: nn.Module, plan: Plan, lengths: list[int], trained: list[Plan], device: torch.device
    ) -> torch.Tensor | None:
        """aux(tokens of micro-batch `plan`) * n_m / N (see the module docstring), or None when inactive or when
        the forward recorded nothing (a no-grad pass). `lengths`: every sample's input length; `trained`: the
        optimizer step's trained micro-batches, whose tokens are N."""
        if not self.active:
            return None
        # a row's samples are packed from position 0 (the HF path shares no prompts, lichen.train.actor)
        fill = [row_width(row, lengths) for row in plan]
        width = max(fill)
        mask = torch.arange(width, device=device)[None] < torch.tensor(fill, device=device)[:, None]
        aux = model.router_aux_loss(mask)
        if aux is None:
            return None
        total = sum(row_width(row, lengths) for mb in trained for row in mb)
        return aux * (sum(fill) / total)
