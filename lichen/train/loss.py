"""The loss phase of a train step: one micro-batch's share of the global-batch loss, from its log-probs.

Every term is aggregated as "this micro-batch's share of the global-batch loss" (lichen.algo.aggregate_loss with
the global batch's counts), so summing the micro-batches' backward passes gives the global batch's gradient
however the samples are split. Metric shares are summed into tensors (`StepSums`) and read once per optimizer
step: one host sync per step, not per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from lichen import algo
from lichen.config.train_config import LossConfig
from lichen.train.train_batch import TrainBatch
from lichen.types import Sample


@dataclass(frozen=True)
class LossPlugins:
    """User plug-ins the loss calls; `args` is the full flag namespace they receive (slime's contract)."""

    custom_loss: Callable | None = None  # fn(args, log_probs=, old_log_probs=, advantages=, mask=, samples=) -> [b, R]
    pg_reducer: Callable | None = None  # fn(per_token_loss, mask, **global_counts) -> scalar
    tis_fn: Callable | None = None  # fn(args, old_log_probs=, rollout_log_probs=, mask=) -> [b, R] weights
    args: Any = None


def tis_weights(
    old: torch.Tensor, rollout_lp: torch.Tensor, *, mode: str, clip_low: float, clip: float
) -> torch.Tensor:
    """Importance weight of the trainer's old policy over the engine's: w = exp(old - rollout), per token.

    truncate: clip(w, low, high); icepop: w where low <= w <= high, else 0. Detached: a weight, not a path.
    """
    w = torch.exp((old - rollout_lp).clamp(-20, 20)).detach()
    if mode == "icepop":
        return torch.where((w >= clip_low) & (w <= clip), w, torch.zeros_like(w))
    return w.clamp(clip_low, clip)


def _policy_terms(cfg: LossConfig, est: str, logp, old, adv, mask):
    """The policy loss of advantage estimator `est` (gspo and cispo have their own), OPSM's mask applied."""
    kw = dict(eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high)
    if est == "gspo":
        out = algo.gspo_policy_loss(logp, old, adv, mask, **kw)
    elif est == "cispo":
        out = algo.cispo_policy_loss(logp, old, adv, **kw)
    else:
        out = algo.ppo_policy_loss(logp, old, adv, eps_clip_c=cfg.eps_clip_c, **kw)
    if cfg.use_opsm:
        adv_seq = algo.masked_mean(adv, mask, dim=-1)
        mask = mask * algo.opsm_mask(logp.detach(), old, adv_seq, mask, cfg.opsm_delta)
    return out, mask


@dataclass
class StepTerms:
    """What the micro-batches of one optimizer step share: the global batch's loss denominators
    (lichen.train.train_batch.global_counts), whether TIS weights apply, and the metric sums they add to."""

    counts: dict
    use_tis: bool
    sums: dict[str, torch.Tensor]


class StepLoss:
    """The loss of a train step (--loss-type, the estimator's policy loss, entropy, KL, TIS, plug-ins);
    `estimator` is --advantage-estimator, which picks the policy loss."""

    def __init__(self, cfg: LossConfig, plugins: LossPlugins, *, estimator: str, router_aux: bool = False):
        self.cfg, self.plugins, self.estimator = cfg, plugins, estimator
        self.router_aux = router_aux  # the step adds --moe-aux-loss-coeff x the router's loss (lichen.train.router_aux)

    def begin_step(self, counts: dict, *, kl_loss: bool, use_tis: bool, device: torch.device) -> StepTerms:
        """The terms of a new optimizer step, its metric sums at 0 (float64, on the device)."""
        keys = ["loss", "pg_loss"]
        if self.cfg.loss_type != "sft_loss":  # SFT has no old policy: no ratio, no clipping, no KL to it
            keys.append("ppo_kl")
            if self.plugins.custom_loss is None:
                keys.append("pg_clipfrac")
        if self.cfg.entropy_coef != 0:
            keys.append("entropy")
        if kl_loss:
            keys.append("kl_loss")
        if use_tis:
            keys += ["tis_weight_mean", "tis_changed_frac"]
        if self.router_aux:
            keys.append("moe_aux_loss")
        return StepTerms(counts, use_tis, {k: torch.zeros((), dtype=torch.float64, device=device) for k in keys})

    def micro_batch(
        self,
        tb: TrainBatch,
        rows: list[int],
        logp: torch.Tensor,
        entropy: torch.Tensor | None,
        step: StepTerms,
        router_aux: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This micro-batch's share of the global-batch loss from its training log-probs `logp` [b, r] (rows
        `rows` of the step), plus --moe-aux-loss-coeff x `router_aux` (its share of the router's load-balancing
        loss, lichen.train.router_aux); adds its metric shares to `step.sums`."""
        cfg, plugins, counts, sums = self.cfg, self.plugins, step.counts, step.sums
        agg = lambda x, m: algo.aggregate_loss(x, m, cfg.loss_agg_mode, **counts)  # noqa: E731
        r = logp.shape[1]
        m = tb.mask[rows, :r]
        adv = tb.advantages[rows, :r]
        old = tb.old_log_probs[rows, :r] if tb.old_log_probs is not None else logp.detach()
        if cfg.loss_type == "sft_loss":
            per_tok, pg = algo.sft_loss(logp), None
        elif plugins.custom_loss is not None:
            # lichen aggregates a custom per-token loss with --loss-agg-mode like every built-in loss.
            samples: list[Sample] = [tb.samples[i] for i in rows]
            per_tok, pg = (
                plugins.custom_loss(
                    plugins.args, log_probs=logp, old_log_probs=old, advantages=adv, mask=m, samples=samples
                ),
                None,
            )
        else:
            pg, m = _policy_terms(cfg, self.estimator, logp, old, adv, m)
            per_tok = pg["loss"]
            if step.use_tis:
                rollout = tb.rollout_log_probs[rows, :r]
                if plugins.tis_fn is not None:
                    w = plugins.tis_fn(plugins.args, old_log_probs=old, rollout_log_probs=rollout, mask=m).detach()
                else:
                    w = tis_weights(old, rollout, mode=cfg.tis_mode, clip_low=cfg.tis_clip_low, clip=cfg.tis_clip)
                raw = torch.exp((old - rollout).clamp(-20, 20))
                per_tok = per_tok * w
                sums["tis_weight_mean"] += agg(w, m).detach()
                sums["tis_changed_frac"] += agg((w != raw).float(), m).detach()
        loss = plugins.pg_reducer(per_tok, m, **counts) if plugins.pg_reducer is not None else agg(per_tok, m)
        sums["pg_loss"] += loss.detach()
        if pg is not None:
            sums["pg_clipfrac"] += agg(pg["clipfrac"].detach(), m)
            sums["ppo_kl"] += agg(pg["ppo_kl"].detach(), m)
        elif "ppo_kl" in sums:  # a custom loss: the KL to the old policy is still measured (first-step check)
            sums["ppo_kl"] += agg((old - logp).detach(), m)
        if entropy is not None:
            ent = agg(entropy, m)
            loss = loss - cfg.entropy_coef * ent
            sums["entropy"] += ent.detach()
        if "kl_loss" in sums:
            imp = (logp - old) if cfg.use_unbiased_kl else None
            kl = agg(algo.approx_kl(logp, tb.ref_log_probs[rows, :r], cfg.kl_loss_type, importance_log_ratio=imp), m)
            loss = loss + cfg.kl_loss_coef * kl
            sums["kl_loss"] += kl.detach()
        if router_aux is not None:
            loss = loss + cfg.moe_aux_loss_coeff * router_aux
            sums["moe_aux_loss"] += router_aux.detach()
        sums["loss"] += loss.detach()
        return loss
