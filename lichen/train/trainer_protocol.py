"""The one contract between the loop and a trainer (docs/architecture.md#the-trainer-contract).

Three classes implement it: the local `TrainActor` (lichen.train.actor), the Ray runtime's `RayTrainGroup`
(lichen.cluster.actor_group: N ranks of lichen.train.dist_trainer.DistTrainer as Ray actors) and `NullTrainer`
(--debug-rollout-only). The loops (lichen/loop.py, lichen/loop_async.py) call only these methods and never ask
which kind of trainer they hold.

Checkpoints: `save` writes the trainer's own files of `iter_N/` and returns their manifest entries (hashed by the
process that wrote each file); lichen.train.checkpoint.save_checkpoint writes everything else of the checkpoint
(rollout_state.json, meta.json, checksums.json, `latest`). `load` restores a checkpoint the driver has already
chosen and verified (lichen.train.checkpoint.find_latest). With --async-save a trainer may also offer
`save_async(save_dir, rollout_id) -> (() -> SavedTrainer) | None`: copy its state now, write the files off the
training path, and return what waits for the writes (None: it saves synchronously this time); checkpoint.py looks it
up with getattr, so a trainer without it (NullTrainer) is saved synchronously. The local and Ray trainers have it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    import torch

    from lichen.train.checkpoint import SavedTrainer
    from lichen.types import Sample

# the sample log's per-token values: name -> one row per requested sample (None: not computed this step)
TokenValues = dict[str, "list[list[float]] | None"]


@runtime_checkable
class Trainer(Protocol):
    """What the loop calls on a trainer, and nothing else."""

    # The weight sender hook of the sync (lichen.sync.push): (HF name, tensor) pairs of the current policy, as
    # the engines serve them; None for a trainer without weights (--debug-rollout-only: the engines keep theirs).
    named_weights: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None

    def train(self, rollout_id: int, batch: list[list[Sample]]) -> dict:
        """One train step on a rollout step's groups of samples; returns its metrics."""
        ...

    def offload(self) -> None:
        """Release the trainer's accelerator memory before the engines need it (a no-op on CPU)."""
        ...

    def onload(self) -> None:
        """Bring back what `offload` released."""
        ...

    def save(self, save_dir: str, rollout_id: int) -> SavedTrainer:
        """Write the trainer's files of checkpoint `rollout_id` and return their manifest entries."""
        ...

    def load(self, load_dir: str, rollout_id: int) -> None:
        """Restore the trainer's state from checkpoint `rollout_id` (verified by the caller)."""
        ...

    def token_values(self, rows: Sequence[int]) -> TokenValues:
        """The last train step's per-token advantages and trainer log-probs of batch rows `rows` (indices into the
        step's flattened batch), for the sample log; {} when the trainer computes none."""
        ...

    def memory_begin(self) -> None:
        """Reset the peak-memory counters of the trainer's processes (a loop phase starts)."""
        ...

    def memory_end(self, phase: str) -> dict[str, float]:
        """The trainer processes' peak memory since `memory_begin`, as `memory/...` metrics of `phase` ({} where
        the trainer runs in the driver's process: the driver's own phase metrics cover it)."""
        ...

    def close(self) -> None:
        """Release the trainer's processes and groups (after the run or its error)."""
        ...


def rows_of(values: dict, rows: Sequence[int]) -> TokenValues:
    """`rows` of each [n, R] tensor (or None) of `values`, as lists (the TokenValues of a trainer that keeps the
    step's per-token values as tensors)."""
    out: TokenValues = {}
    for key, tensor in values.items():
        out[key] = None if tensor is None else [tensor[i].tolist() for i in rows]
    return out
