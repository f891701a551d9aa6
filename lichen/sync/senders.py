"""How the driver's half of a transport reaches the sending half (lichen.weights.rank_send.RankSender).

A sender handle offers `submit(op, *args, all_ranks=True) -> Future` (rank 0's result) and `call(...)` (its
result, waited for). Two kinds:

- the trainer's own, when it has `weight_sender()`: under `--runtime ray`, RayTrainGroup's, whose ops run in
  every trainer rank (lichen.cluster.actor_group.RankWeightSender); the driver receives checksums and metadata,
  never a tensor;
- `InProcessSender`: the local trainer's weights (`trainer.named_weights()`) in this process, its ops on one
  helper thread, so the driver half can wait on the engines' answers while a collective blocks.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any, Iterable

import torch

from lichen.weights.rank_send import RankSender, local_gather, tensor_meta


class InProcessSender:
    """RankSender over tensors this process holds (rank 0 of one); `bind` gives it the weights of a sync."""

    def __init__(self) -> None:
        self._state: dict[str, torch.Tensor] = {}
        self.impl = RankSender(0, local_gather(self._state), self._meta)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lichen-weight-sender")

    def bind(self, named: Iterable[tuple[str, torch.Tensor]]) -> InProcessSender:
        self._state.clear()
        self._state.update(named)
        if not self._state:
            raise ValueError("the trainer has no weights to send")
        return self

    def _meta(self) -> list[list]:
        return [tensor_meta(n, t) for n, t in self._state.items()]

    def submit(self, op: str, *args: Any, all_ranks: bool = True) -> concurrent.futures.Future:
        return self._pool.submit(getattr(self.impl, op), *args)

    def call(self, op: str, *args: Any, all_ranks: bool = True) -> Any:
        return getattr(self.impl, op)(*args)

    def close(self) -> None:
        self.impl.group_close()
        self._pool.shutdown(wait=False)


def trainer_sender(trainer: Any) -> Any | None:
    """The trainer's own sender handle (its ranks send), or None (send from `trainer.named_weights()` here)."""
    make = getattr(trainer, "weight_sender", None)
    return make() if make is not None else None


def wait_with_engines(fut: concurrent.futures.Future, pending: Any) -> Any:
    """The sender's result `fut`, raising the engines' error as soon as one of them answered with one (it will
    never join the collective the sender is blocked in), instead of waiting for the collective's timeout."""
    while True:
        if pending.done() and pending.exception() is not None:
            raise pending.exception()
        try:
            return fut.result(timeout=0.05)
        except concurrent.futures.TimeoutError:
            time.sleep(0)
