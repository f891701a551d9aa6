"""The data model shared by rollout and training (docs/architecture.md#sample-data-model).

A `Sample` is one trajectory: prompt, the full token sequence (prompt + response), the response's per-token
loss mask and rollout log-probs, reward, status and the weight versions that generated it. Rollout returns
`list[list[Sample]]`, one inner list per prompt group of `--n-samples-per-prompt` samples.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Status(str, Enum):
    PENDING = "pending"
    COMPLETED = "completed"  # stopped on EOS / a stop token
    TRUNCATED = "truncated"  # hit --rollout-max-response-len
    ABORTED = "aborted"
    FAILED = "failed"  # verifier raised / timed out / returned a non-finite value: zero weight in the loss


@dataclass
class Sample:
    prompt: Any = ""  # str, or a list of chat messages [{role, content}]
    tokens: list[int] = field(default_factory=list)  # prompt tokens + response tokens
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict | None = None
    loss_mask: list[int] | None = None  # one entry per response token (1 = trained on)
    rollout_log_probs: list[float] | None = None  # one per response token, log_softmax(logits / T)
    # one per response token: the sorted token ids top-p / top-k kept when it was sampled (None: the full
    # vocabulary); rollout_log_probs and the trainer's log-probs are then over that set (sampling-mask replay)
    rollout_sampling_mask: list[list[int]] | None = None
    # one per response token: log p_teacher(token | prefix) from the teacher's servers (--opd-type sglang)
    teacher_log_probs: list[float] | None = None
    status: Status = Status.PENDING
    weight_versions: list[str] = field(default_factory=list)
    metadata: dict = field(default_factory=dict)
    group_index: int = 0  # index of the prompt in the dataset order of this rollout step
    index: int = 0  # global sample index: group_index * n_samples_per_prompt + sample position

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[len(self.tokens) - self.response_length :]

    def scalar_reward(self, reward_key: str | None = None) -> float:
        """The reward as a float; a dict reward is read at `reward_key` (default key 'score')."""
        r = self.reward
        if isinstance(r, dict):
            return float(r[reward_key or "score"])
        return float(r) if r is not None else 0.0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Sample":
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        kwargs["status"] = Status(kwargs.get("status", "pending"))
        return cls(**kwargs)
