"""The PPO critic: a value head on the same architecture as the policy, trained on GAE returns.

V(s_t) is read at the position whose hidden state predicts response token t — the state before the token is
chosen — so values line up with the per-token log-probs and advantages [B, R].

Each step (--advantage-estimator ppo):
    token rewards r_t = -kl_coef * KL_t, plus the scalar reward at the last response token
    V_old  = critic(samples)                               (no grad)
    A, R   = GAE(r, V_old; gamma, lambd)                   (lichen.algo.gae_advantages)
    critic loss = 0.5 * max((V - R)^2, (clip(V, V_old ± value_clip) - R)^2), aggregated like the policy loss
The policy is not updated during the first --num-critic-only-steps rollout steps, so the critic can catch up.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from lichen import algo
from lichen.config.train_config import TrainerConfig
from lichen.models import CausalLM, load_model
from lichen.train.micro_batches import Plan, StepBatch
from lichen.train.optim import clip_and_step, make_adamw
from lichen.train.train_batch import TrainBatch


class ValueModel(nn.Module):
    def __init__(self, backbone: CausalLM):
        super().__init__()
        self.backbone = backbone
        # Zero init: every state starts valued at 0, so the first advantages are the plain returns.
        self.value_head = nn.Linear(backbone.cfg.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, mb) -> torch.Tensor:
        hidden = self.backbone(mb.input_ids, mb.position_ids, attn_mask=mb.attn_mask)
        # A new tensor, not a view: FSDP2 (the multi-rank critic) warns about views returned by a sharded module.
        return self.value_head(mb.response_hidden(hidden)).squeeze(-1).to(torch.float32, copy=True)  # [b, R]


class Critic:
    """The value model and its optimizer; `cfg.critic.optimizer` is --critic-lr (default --lr) with the policy's
    AdamW settings. It reads `cfg.critic`, its backbone's `cfg.models` and the policy's `cfg.loss.loss_agg_mode`."""

    def __init__(self, cfg: TrainerConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        models = cfg.models
        backbone = load_model(
            models.critic_load or models.hf_checkpoint, device=device, dtype=torch.float32, **models.model_options
        )
        backbone.gradient_checkpointing = models.gradient_checkpointing
        self.model = ValueModel(backbone).to(device)
        self.model.train()
        self.optimizer = self.make_optimizer()

    def make_optimizer(self) -> torch.optim.Optimizer:
        # The LM head is unused by the critic; leaving it out of the optimizer keeps AdamW from decaying it.
        params = [p for n, p in self.model.named_parameters() if "lm_head" not in n]
        opt = self.cfg.critic.optimizer
        return make_adamw(params, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)

    @torch.no_grad()
    def values(self, sb: StepBatch, plans: list[Plan], width: int) -> torch.Tensor:
        out = torch.zeros((len(sb.samples), width), device=self.device)
        for plan in plans:
            mb = sb.micro(plan, self.device)
            v = self.model(mb)
            out[mb.indices, : v.shape[1]] = v
        return out

    def train_step(self, tb: TrainBatch, plans: list[Plan], counts: dict) -> dict:
        """One AdamW step on the global batch cut into `plans`, toward the GAE returns of `tb`."""
        critic = self.cfg.critic
        agg_mode = self.cfg.loss.loss_agg_mode
        agg = lambda x, m: algo.aggregate_loss(x, m, agg_mode, **counts)  # noqa: E731
        self.optimizer.zero_grad(set_to_none=True)
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # value loss, clip fraction

        def loss_of(plan: Plan) -> torch.Tensor:
            mb = tb.host.micro(plan, self.device)
            rows = mb.indices
            r = mb.resp_mask.shape[1]
            m = tb.mask[rows, :r]
            old = tb.values[rows, :r]
            v = self.model(mb)
            loss = agg(algo.value_loss(v, old, tb.returns[rows, :r], m, value_clip=critic.value_clip), m)
            sums[0] += loss.detach()
            if critic.value_clip is not None:
                sums[1] += agg(((v.detach() - old).abs() > critic.value_clip).float(), m)
            return loss

        total, clipfrac = self._backward(tb, plans, loss_of, sums).tolist()
        grad_norm, _ = clip_and_step(
            self.optimizer,
            self.model.parameters(),
            clip_grad=critic.optimizer.clip_grad,
            has_samples=counts["global_num_samples"] > 0,
        )
        return {"critic/value_loss": total, "critic/value_clipfrac": clipfrac, "critic/grad_norm": float(grad_norm)}

    def _backward(
        self, tb: TrainBatch, plans: list[Plan], loss_of: Callable[[Plan], torch.Tensor], sums: torch.Tensor
    ) -> torch.Tensor:
        """The backward of every micro-batch; returns `sums` (the multi-rank critic runs its share and sums them
        over the ranks, lichen.train.dist_critic)."""
        for plan in plans:
            loss_of(plan).backward()
        return sums

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        if "optimizer" in state:  # absent: saved with --no-save-optim, this optimizer starts fresh
            self.optimizer.load_state_dict(state["optimizer"])
