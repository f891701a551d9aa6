"""The trainer's AdamW, built with the fastest torch implementation the parameters allow.

All three torch implementations (fused, foreach, single-tensor) compute the same update, per parameter:
    m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2;   p = p (1 - lr wd)
    p = p - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
and differ only in how many kernels they launch (fused: one per parameter group and dtype, including on CPU;
single-tensor: about ten per parameter), hence in fp32 rounding only.

Weight decay follows Megatron's rule (slime's optimizer): only parameters of two or more dimensions decay; biases
and norm weights (the one-dimensional parameters) are not decayed.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

_FUSED_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_ADAM_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # the last with amsgrad only


def adamw_implementation(params: list[torch.Tensor]) -> str:
    """ "fused" when every parameter's device type and dtype have torch's fused AdamW kernel, else "foreach"."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    fused_devices = set(_get_fused_kernels_supported_devices())
    if params and all(p.device.type in fused_devices and p.dtype in _FUSED_DTYPES for p in params):
        return "fused"
    return "foreach"


def make_adamw(
    params: Iterable[torch.Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    implementation: str | None = None,
) -> torch.optim.AdamW:
    """torch.optim.AdamW over `params` with `implementation` ("fused", "foreach" or "single"; default: the fastest
    supported, see adamw_implementation)."""
    params = [p for p in params]
    kind = implementation or adamw_implementation(params)
    if kind not in ("fused", "foreach", "single"):
        raise ValueError(f"unknown AdamW implementation {kind!r}; choose fused, foreach or single")
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "single": {"foreach": False}}[kind]
    return torch.optim.AdamW(
        decay_groups(params, weight_decay), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **flags
    )


def decay_groups(params: list[torch.Tensor], weight_decay: float) -> list[dict]:
    """Parameter groups: matrices (and higher) decay by `weight_decay`, 1-D parameters (biases, norm weights) do
    not, as in Megatron. Without weight decay there is one group, as before the split (older checkpoints load)."""
    decay = [p for p in params if p.ndim >= 2]
    keep = [p for p in params if p.ndim < 2]
    if weight_decay == 0 or not decay or not keep:
        return [{"params": params, "weight_decay": weight_decay if decay else 0.0}]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]


def clip_and_step(
    optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor], *, clip_grad: float, has_samples: bool
) -> tuple[torch.Tensor, bool]:
    """Clip the global gradient norm to `clip_grad` (0: measure only) and step, unless the global batch had no
    trainable sample or the norm is not finite. Returns (grad norm, whether the optimizer stepped).

    The gradients are freed afterwards: every step starts from `zero_grad(set_to_none=True)`, so nothing reads
    them again, and holding them through rollout and weight sync would cost one more copy of the trained
    parameters (a rank's shard under FSDP2) at the phase where the engine needs the memory."""
    params = list(params)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, clip_grad if clip_grad > 0 else float("inf"))
    stepped = has_samples and bool(torch.isfinite(grad_norm))
    if stepped:
        optimizer.step()
    for p in params:
        p.grad = None
    return grad_norm, stepped


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def reset_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """slime's --reset-optimizer-states: every parameter's step count and Adam moments back to zero, in place (the
    tensors stay where they are: on their device, FSDP2 shards as DTensors, offloaded or not). The learning rate
    is set per step from lichen.train.lr_schedule, so the schedule goes on. The next step is a fresh AdamW's first
    step: bias correction 1 - b^1."""
    for group in optimizer.param_groups:
        if "step" in group:  # optimizers that count per group (torch's AdamW counts per parameter)
            group["step"] = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if key == "step" or key in _ADAM_MOMENTS:
                if isinstance(value, torch.Tensor):
                    value.zero_()
                else:
                    state[key] = 0
