"""The response of a multi-turn custom generate function as it grows: the policy's tokens with their rollout
log-probs (loss mask 1), tokens it did not produce (tool output: loss mask 0, log-prob 0.0), and the weight
versions that produced it; `fill` writes it into the Sample (docs/agentic.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lichen.types import Sample, Status


@dataclass
class Trajectory:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)

    def add_policy(self, ids: list[int], logprobs: list[float], version: str) -> None:
        """Tokens the engine generated, exactly as it returned them."""
        self.tokens += ids
        self.logprobs += logprobs
        self.mask += [1] * len(ids)
        if version not in self.versions:
            self.versions.append(version)

    def add_context(self, ids: list[int]) -> None:
        """Tokens fed to the model but not produced by it: never trained on."""
        self.tokens += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)

    def fill(self, sample: Sample, tokenizer: Any, prompt: list[int], status: Status) -> Sample:
        sample.tokens = prompt + self.tokens
        sample.response_length = len(self.tokens)
        sample.response = tokenizer.decode(self.tokens, skip_special_tokens=True)
        sample.loss_mask = self.mask
        sample.rollout_log_probs = self.logprobs
        sample.weight_versions = self.versions
        sample.status = status
        return sample
