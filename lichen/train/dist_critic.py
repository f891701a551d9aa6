"""The PPO critic of a multi-rank trainer: FSDP2-sharded like the policy, its micro-batches split the same way.

Every rank gets the same global batch: the value pass fills each rank's rows and sums them over the ranks; the
critic's step runs this rank's share of its micro-batches (padded with empty ones to every rank's count, so the
collectives stay matched), its gradients and loss sums are summed over the ranks (lichen.train.fsdp).
"""

from __future__ import annotations

from typing import Callable

import torch

from lichen.config.train_config import TrainerConfig
from lichen.train import fsdp
from lichen.train.critic import Critic
from lichen.train.micro_batches import Plan, StepBatch
from lichen.train.step_schedule import split_across_ranks
from lichen.train.train_batch import TrainBatch


class RankCritic(Critic):
    def __init__(self, cfg: TrainerConfig, device: torch.device, *, rank: int, world_size: int):
        super().__init__(cfg, device)
        self.rank, self.world_size = rank, world_size
        fsdp.shard(  # the critic runs in fp32
            self.model,
            layers=fsdp.decoder_layers(self.model.backbone),
            bf16=False,
            cpu_offload=fsdp.offloads_to_cpu(cfg.optimizer_state.optimizer_cpu_offload, device),
        )
        self.optimizer = self.make_optimizer()  # over this rank's shards

    def _empty_forward(self, sb: StepBatch) -> torch.Tensor:
        """A forward whose result is 0: it only keeps the collectives matched."""
        return self.model(sb.micro([[0]], self.device)).sum() * 0.0

    @torch.no_grad()
    def values(self, sb: StepBatch, plans: list[Plan], width: int) -> torch.Tensor:
        mine = split_across_ranks(plans, sb.input_lengths, self.world_size, sb.sharing)[self.rank]
        out = super().values(sb, [p for p in mine if p is not None], width)
        for _ in range(mine.count(None)):
            self._empty_forward(sb)
        fsdp.reshard(self.model)
        return fsdp.all_reduce_sum(out)

    def _backward(
        self, tb: TrainBatch, plans: list[Plan], loss_of: Callable[[Plan], torch.Tensor], sums: torch.Tensor
    ) -> torch.Tensor:
        for plan in split_across_ranks(plans, tb.host.input_lengths, self.world_size, tb.host.sharing)[self.rank]:
            (loss_of(plan) if plan is not None else self._empty_forward(tb.host)).backward()
        fsdp.reshard(self.model)  # parameters() are the sharded ones again, with their gradients
        return fsdp.all_reduce_sum(sums)
