"""The tensors of one train step, filled phase by phase (lichen.train.actor.TrainActor.train).

Every tensor is [n, R] on the trainer's device: n samples of the step, R the longest response. `host` keeps the
padded tokens on the host, where micro-batches are cut from (lichen.train.micro_batches.StepBatch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lichen.train.micro_batches import StepBatch
from lichen.types import Sample


@dataclass
class TrainBatch:
    host: StepBatch
    mask: torch.Tensor  # the loss mask: 0 on padding and on failed samples
    rollout_log_probs: torch.Tensor | None  # the engine's, when every sample has them
    # log-probs phase (no-grad passes)
    old_log_probs: torch.Tensor | None = None  # None: the training forward's own (detached) log-probs serve
    ref_log_probs: torch.Tensor | None = None
    policy_log_probs: torch.Tensor | None = None  # the current policy's, where advantages need them
    teacher_log_probs: torch.Tensor | None = None  # on-policy distillation
    values: torch.Tensor | None = None  # the critic's V(s_t) (--advantage-estimator ppo)
    # advantages phase
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None  # GAE returns, the critic's targets

    @classmethod
    def from_samples(
        cls, samples: list[Sample], pad_id: int, device: torch.device, share_prompts: bool = False
    ) -> "TrainBatch":
        """`share_prompts`: samples with identical prompts compute them once (lichen.train.micro_batches)."""
        host = StepBatch(samples, pad_id, share_prompts)  # padded once, on the host
        return cls(host=host, mask=host.resp_mask.to(device), rollout_log_probs=host.rollout_log_probs(device))

    @property
    def samples(self) -> list[Sample]:
        return self.host.samples

    @property
    def num_samples(self) -> int:
        return len(self.host.samples)

    @property
    def response_width(self) -> int:
        return self.mask.shape[1]

    @property
    def old_is_rollout(self) -> bool:
        """--use-rollout-logprobs: the engine's log-probs stand in for the trainer's old ones."""
        return self.old_log_probs is not None and self.old_log_probs is self.rollout_log_probs


def global_counts(mask: torch.Tensor, max_response_len: int) -> dict:
    """The denominators of a global batch's loss (lichen.algo.aggregate_loss), from its [b, R] loss mask: every
    micro-batch's share is normalized by the whole global batch, skipped samples included."""
    return dict(
        global_num_samples=int((mask.sum(-1) > 0).sum()),
        global_num_tokens=int(mask.sum()),
        max_response_len=max_response_len,
    )
