"""The rollout's data source: the prompt data set's resumable position plus the groups held to be continued.

It is the `data_source` every rollout function receives (lichen.rollout.base_types), with slime's interface:
- `get_samples(n)`: n groups; groups held by `add_samples` first (oldest first), then new prompts, each as
  --n-samples-per-prompt pending Samples whose `tokens` are the encoded prompt (numbered in the order returned:
  group_index = 0..n-1, index = group_index * n_samples + j);
- `add_samples(groups)`: groups to continue next step (the partial-rollout buffer, lichen.rollout.partial);
- `state_dict()` / `load_state_dict()`: the data position and the held groups (part of every checkpoint).
lichen's own rollout also uses the finer `get_prompts(n)` (the next n (data index, PromptRecord) pairs) and
`buffer` (the PartialBuffer of held groups).
"""

from __future__ import annotations

from typing import Any, Callable

from lichen.data import DataSource, PromptSource
from lichen.rollout.partial import PartialBuffer
from lichen.types import Sample, Status


class RolloutDataSource(DataSource):
    def __init__(
        self, source: PromptSource, *, n_samples_per_prompt: int, encode: Callable[[int, Any], list[int]]
    ) -> None:
        self.source = source
        self.buffer = PartialBuffer()
        self.n_samples_per_prompt = n_samples_per_prompt
        self._encode = encode

    def __len__(self) -> int:
        return len(self.source)

    @property
    def num_rollout_per_epoch(self) -> int:
        return self.source.num_batches_per_epoch

    def get_prompts(self, count: int) -> list[tuple[int, Any]]:
        """Exactly the next `count` prompts as (data index, record), advancing the position by `count`."""
        return self.source.take(count)

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        held = self.buffer.take_all()
        groups, back = held[:num_samples], held[num_samples:]
        for group in back:  # more held than asked for: the rest stays, in order
            self.buffer.put(group)
        n = self.n_samples_per_prompt
        for data_index, record in self.get_prompts(num_samples - len(groups)):
            ids = self._encode(data_index, record)
            groups.append(
                [
                    Sample(
                        prompt=record.prompt,
                        tokens=list(ids),
                        label=record.label,
                        status=Status.PENDING,
                        metadata={**(record.metadata or {}), "prompt_index": data_index},
                    )
                    for _ in range(n)
                ]
            )
        for g, group in enumerate(groups):
            for j, s in enumerate(group):
                s.group_index, s.index = g, g * n + j
        return groups

    def add_samples(self, samples: list[list[Sample]]) -> None:
        for group in samples:
            self.buffer.put(group)

    def state_dict(self) -> dict:
        return {"source": self.source.state_dict(), "partial_rollout": self.buffer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.source.load_state_dict(state["source"])
        self.buffer.load_state_dict(state.get("partial_rollout"))  # absent in older checkpoints: empty
