"""Per-token KL estimators between the current policy and a reference policy (for --kl-loss-type / --kl-coef).

With log_ratio = log_probs - ref_log_probs, i.e. log(pi / pi_ref) at the sampled token (an estimate of
KL(pi || pi_ref) when tokens are sampled from pi):

- ``k1`` (alias ``kl``): log_ratio                                  (unbiased, high variance, can be negative)
- ``k2``:                log_ratio^2 / 2                            (biased, always >= 0)
- ``k3``:                exp(-log_ratio) - 1 + log_ratio            (unbiased, always >= 0, low variance)
- ``low_var_kl``:        k3 clamped to [-10, 10]                    (guards against exploding ratios)

`importance_log_ratio` (for --use-unbiased-kl): tokens were sampled from the behaviour policy, not from pi,
so each estimate is reweighted by exp(importance_log_ratio) = pi / pi_old, detached (a weight, not a path
for gradients). Callers pass log_probs - old_log_probs.
"""

from __future__ import annotations

import torch
from torch import Tensor

KL_TYPES = ("k1", "kl", "k2", "k3", "low_var_kl")

# exp(-x) for |x| > 20 already puts low_var_kl at its clamp, so clamping the input there changes no value but
# keeps exp finite (an inf in the forward would turn the zero gradient of the outer clamp into NaN).
_LOW_VAR_LOG_RATIO_CLAMP = 20.0
_LOW_VAR_KL_CLAMP = 10.0


def approx_kl(
    log_probs: Tensor,
    ref_log_probs: Tensor,
    kl_type: str,
    importance_log_ratio: Tensor | None = None,
) -> Tensor:
    """Elementwise KL estimate of type `kl_type` (see module docstring); same shape as `log_probs`.

    Gradients flow to `log_probs` (and `ref_log_probs` if it requires grad), never through
    `importance_log_ratio`.
    """
    log_ratio = log_probs - ref_log_probs
    if kl_type in ("k1", "kl"):
        kl = log_ratio
    elif kl_type == "k2":
        kl = log_ratio.square() / 2
    elif kl_type == "k3":
        kl = torch.exp(-log_ratio) - 1 + log_ratio
    elif kl_type == "low_var_kl":
        x = log_ratio.clamp(-_LOW_VAR_LOG_RATIO_CLAMP, _LOW_VAR_LOG_RATIO_CLAMP)
        kl = (torch.exp(-x) - 1 + x).clamp(-_LOW_VAR_KL_CLAMP, _LOW_VAR_KL_CLAMP)
    else:
        raise ValueError(f"unknown KL type {kl_type!r} (--kl-loss-type); choose one of {', '.join(KL_TYPES)}")
    if importance_log_ratio is not None:
        kl = kl * torch.exp(importance_log_ratio.detach())
    return kl
