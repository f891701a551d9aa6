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

import os

import torch
from torch import nn

from lichen import algo
from lichen.errors import ConfigError
from lichen.models import CausalLM, load_model
from lichen.torch_files import load_plain, save_plain
from lichen.train.micro_batches import StepBatch
from lichen.train.optim import make_adamw

CRITIC_FILE = "critic.pt"


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
        return self.value_head(mb.response_hidden(hidden)).squeeze(-1).float()  # [b, R]


class Critic:
    def __init__(self, args, device, pad_id: int):
        self.args, self.device, self.pad_id = args, device, pad_id
        backbone = load_model(args.critic_load or args.hf_checkpoint, device=device, dtype=torch.float32)
        backbone.gradient_checkpointing = bool(args.gradient_checkpointing)
        self.model = ValueModel(backbone).to(device)
        self.model.train()
        # The LM head is unused by the critic; leaving it out of the optimizer keeps AdamW from decaying it.
        params = [p for n, p in self.model.named_parameters() if "lm_head" not in n]
        self.optimizer = make_adamw(params, lr=args.critic_lr or args.lr, betas=(args.adam_beta1, args.adam_beta2),
                                    eps=args.adam_eps, weight_decay=args.weight_decay)

    @torch.no_grad()
    def values(self, sb: StepBatch, splits, R: int) -> torch.Tensor:
        out = torch.zeros((len(sb.samples), R), device=self.device)
        for plan in splits:
            mb = sb.micro(plan, self.device)
            v = self.model(mb)
            out[mb.indices, : v.shape[1]] = v
        return out

    def train_step(self, sb: StepBatch, splits, mask, old_values, returns, counts: dict) -> dict:
        args = self.args
        self.optimizer.zero_grad(set_to_none=True)
        total, clipfrac = 0.0, 0.0
        for plan in splits:
            mb = sb.micro(plan, self.device)
            rows = mb.indices
            r = mb.resp_mask.shape[1]
            m = mask[rows, :r]
            v = self.model(mb)
            per_tok = algo.value_loss(v, old_values[rows, :r], returns[rows, :r], m, value_clip=args.value_clip)
            loss = algo.aggregate_loss(per_tok, m, args.loss_agg_mode, **counts)
            loss.backward()
            total += float(loss.detach())
            if args.value_clip is not None:
                moved = ((v.detach() - old_values[rows, :r]).abs() > args.value_clip).float()
                clipfrac += float(algo.aggregate_loss(moved, m, args.loss_agg_mode, **counts))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), args.clip_grad if args.clip_grad > 0 else float("inf"))
        if counts["global_num_samples"] > 0 and torch.isfinite(grad_norm):
            self.optimizer.step()
        return {"critic/value_loss": total, "critic/value_clipfrac": clipfrac, "critic/grad_norm": float(grad_norm)}

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def save(self, directory: str) -> None:
        save_plain(self.state_dict(), os.path.join(directory, CRITIC_FILE))

    def load(self, directory: str) -> None:
        """Restore from `directory`/critic.pt, read with weights_only=True (tensors land on the CPU; load_state_dict
        copies them onto the critic's device)."""
        path = os.path.join(directory, CRITIC_FILE)
        if not os.path.isfile(path):
            raise ConfigError(f"checkpoint {directory} has no {CRITIC_FILE}: it was saved without "
                              "--advantage-estimator ppo; resume it with the estimator it was saved with")
        self.load_state_dict(load_plain(path, "checkpoint file"))
