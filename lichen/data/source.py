"""The resumable prompt source: hands out `--rollout-batch-size` prompts per rollout step, epoch after epoch.

Epoch e visits every record once, in the order
    order(e) = permutation of range(N) drawn from numpy's PCG64 seeded with SeedSequence([seed, e])   (shuffle)
    order(e) = 0, 1, ..., N-1                                                                          (no shuffle)
The position is just (epoch, offset into order(epoch)); since order(e) is a pure function of (seed, e, N), saving
those two numbers is enough to resume with exactly the batches an uninterrupted run would have drawn. A batch
that reaches the end of an epoch is filled from the start of the next one.
"""

from __future__ import annotations

import abc
import logging
from typing import Any

import numpy as np

from lichen.data.dataset import PromptRecord
from lichen.errors import ConfigError, DataError

_STATE_VERSION = 1
logger = logging.getLogger(__name__)


class DataSource(abc.ABC):
    """What a rollout function receives as `data_source` (slime's interface; groups are list[list[Sample]])."""

    @abc.abstractmethod
    def get_samples(self, num_samples: int) -> list[list[Any]]:
        """The next `num_samples` groups of samples to generate."""

    @abc.abstractmethod
    def add_samples(self, samples: list[list[Any]]) -> None:
        """Groups handed back, to be returned first by a later `get_samples`."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The position (and held groups), saved in every checkpoint."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict()`."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Prompts in the data set."""


class PromptSource:
    """Walks `records` in (optionally shuffled) epochs, `batch_size` at a time; see the module docstring."""

    def __init__(self, records: list[PromptRecord], *, batch_size: int, shuffle: bool, seed: int) -> None:
        if batch_size < 1:
            raise ConfigError(f"--rollout-batch-size must be at least 1, got {batch_size}")
        if len(records) < batch_size:
            raise DataError(
                f"the data set has {len(records)} prompts but --rollout-batch-size is {batch_size}; use a larger "
                f"data set or a smaller --rollout-batch-size"
            )
        self.records = records
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = int(seed)
        self._epoch = 0
        self._offset = 0
        self._order_epoch = -1
        self._order: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.records)

    @property
    def epoch(self) -> int:
        """The epoch the next prompt comes from (0-based)."""
        return self._epoch

    @property
    def offset(self) -> int:
        """How many prompts of the current epoch have been handed out."""
        return self._offset

    @property
    def num_batches_per_epoch(self) -> int:
        return max(1, len(self.records) // self.batch_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The record indices of `epoch` in visiting order (cached for the current epoch)."""
        if epoch != self._order_epoch or self._order is None:
            n = len(self.records)
            if self.shuffle:
                # seed % 2**64 keeps negative --seed values valid for SeedSequence and distinct from positive ones
                rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed % (1 << 64), epoch])))
                order = rng.permutation(n)
            else:
                order = np.arange(n)
            self._order, self._order_epoch = order, epoch
        return self._order

    def next_batch(self) -> list[tuple[int, PromptRecord]]:
        """The next `batch_size` (record index, record) pairs; crosses into the next epoch when one runs out."""
        out: list[tuple[int, PromptRecord]] = []
        n = len(self.records)
        while len(out) < self.batch_size:
            order = self.epoch_order(self._epoch)
            take = min(self.batch_size - len(out), n - self._offset)
            for i in order[self._offset : self._offset + take]:
                out.append((int(i), self.records[int(i)]))
            self._offset += take
            if self._offset == n:
                self._epoch, self._offset = self._epoch + 1, 0
        return out

    def take(self, count: int) -> list[tuple[int, PromptRecord]]:
        """Exactly the next `count` prompts (none for count <= 0), advancing the position by `count`."""
        if count <= 0:
            return []
        saved = self.batch_size
        self.batch_size = count
        try:
            return self.next_batch()
        finally:
            self.batch_size = saved

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "epoch": self._epoch,
            "offset": self._offset,
            "num_records": len(self.records),
            "shuffle": self.shuffle,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; the data set must have as many prompts as when it was saved."""
        n_saved = int(state["num_records"])
        if n_saved != len(self.records):
            raise DataError(
                f"the checkpoint's data source was saved with {n_saved} prompts but --prompt-data now has "
                f"{len(self.records)}; resume with the same data set (and row slice) or start a new run"
            )
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if epoch < 0 or not 0 <= offset < max(1, n_saved):
            raise DataError(f"the checkpoint's data source state is corrupt: epoch={epoch}, offset={offset}")
        if state.get("shuffle", self.shuffle) != self.shuffle or state.get("seed", self.seed) != self.seed:
            # allowed (a deliberate reshuffle), but the prompt order then differs from the uninterrupted run's
            logger.warning(
                "data source resumed with shuffle=%s seed=%s but saved with shuffle=%s seed=%s; prompt order will "
                "differ from the original run",
                self.shuffle,
                self.seed,
                state.get("shuffle"),
                state.get("seed"),
            )
        self._epoch, self._offset = epoch, offset
