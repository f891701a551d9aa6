"""The response of a multi-turn custom generate function as it grows: the policy's tokens with their rollout
log-probs (loss mask 1), tokens it did not produce (tool output: loss mask 0, log-prob 0.0), the weight
versions that produced it and the engine server of each turn; `fill` writes it into the Sample (docs/agentic.md)."""

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
    engines: list[str] = field(default_factory=list)  # per engine call (turn): the server's URL, "" in process

    def add_policy(self, ids: list[int], logprobs: list[float], version: str, engine: str = "") -> None:
        """Tokens the engine generated, exactly as it returned them."""
        self.engines.append(engine)
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
        if any(self.engines):  # the sample log shows which server made each turn
            sample.metadata["engine"] = list(self.engines)
        return sample


def add_engine(metadata: dict, engine: str) -> None:
    """Note one more engine call's server in metadata["engine"]: a string while the sample has one call, a list
    (one entry per call) once it has several; nothing for the in-process engine ("")."""
    if not engine:
        return
    had = metadata.get("engine")
    metadata["engine"] = engine if had is None else [*(had if isinstance(had, list) else [had]), engine]
