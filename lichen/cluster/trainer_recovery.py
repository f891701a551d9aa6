"""A trainer rank's death, recovered (`--max-trainer-restarts N`, `--runtime ray`; docs/fault-tolerance.md).

When a rank's actor dies or raises (kill -9, OOM, a collective that times out), RayTrainGroup has already killed
every rank (lichen.cluster.actor_group: `RankFailed`). With restarts left, `TrainerRestarts.recover`:

1. starts new ranks on the same placement-group bundles, set up as at the start (RayTrainGroup.restart);
2. rewinds to the newest intact checkpoint of this run (--save, else the --load it started from) through the
   loop's own --load path: trainer weights, optimizer and RNG, data position and rollout state; with no
   checkpoint yet, back to step 0: the initial weights of the new ranks and the rollout state the run began with;
3. re-syncs the engines to that checkpoint's weight version (the transports start over: their state, such as a
   broadcast group, belonged to the dead ranks);
4. lets the driver go on from the step after the checkpoint. With seeded sampling the replayed steps are the
   same steps, so the run ends with the weights of an uninterrupted run.

The loop owns the phases, so the rewind and the re-sync come in as functions from lichen.loop (this package may
not import the loop or the sync). One summary line per event (which rank, its exit cause, what was done, how long
it took); the metrics of the next step carry `fault/trainer_restarts` (so far), `fault/steps_replayed` (completed
steps trained again) and `time/trainer_recovery`.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Iterator

from lichen.cluster.actor_group import RankFailed
from lichen.errors import RunError
from lichen.observe.metrics import get_logger
from lichen.train import checkpoint as ckpt

log = get_logger(__name__)


def rank_failure(error: BaseException) -> RankFailed | None:
    """The RankFailed behind `error`: itself, or the cause of an error raised over it (a weight sync that failed
    because its sending rank died)."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, RankFailed):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


class TrainerRestarts:
    """The restarts of one run: how many are left, where to rewind to, the step the driver runs next."""

    def __init__(
        self, max_restarts: int, *, start: int, save_dir: str | None, load_dir: str | None, initial_state: dict | None
    ) -> None:
        self.max_restarts = max_restarts
        self.start = start  # the run's first step: a checkpoint older than its predecessor is another run's
        self.dirs = [d for d in (save_dir, load_dir) if d]
        self.initial_state = initial_state  # the rollout state at `start`, for a rewind without a checkpoint
        self.restarts = 0
        self.next_id = start
        self._metrics: dict[str, float] = {}

    def steps(self, end: int) -> Iterator[int]:
        """The rollout ids to run, from the start to `end` - 1; after a recovery, again from its checkpoint's."""
        while self.next_id < end:
            rollout_id = self.next_id
            self.next_id += 1
            yield rollout_id

    def take_metrics(self) -> dict[str, float]:
        """The metrics of the last recovery, once: the step that follows it logs them."""
        out, self._metrics = self._metrics, {}
        return out

    def checkpoint(self) -> tuple[str, int] | None:
        """(directory, rollout id) of the newest intact checkpoint of this run, or None (rewind to the start)."""
        for d in self.dirs:
            if not os.path.isdir(d):  # --save before its first checkpoint
                continue
            last = ckpt.find_latest(d)
            if last is not None and last >= self.start - 1:
                return d, last
        return None

    def recover(
        self,
        error: BaseException,
        rollout_id: int,
        trainer: Any,
        rewind: Callable[[str | None, dict | None], int],
        resync: Callable[[int], Any],
    ) -> None:
        """Recover from `error` raised at step `rollout_id`, or raise it again: not a rank's failure, no restarts
        left, or a trainer that cannot restart. `rewind(load_dir, initial_state)` restores the trainer and the
        rollout (from `load_dir`, else the initial state) and returns the first step to run; `resync(version)`
        pushes the trainer's weights to the engines as that version."""
        failure = rank_failure(error)
        if failure is None or not hasattr(trainer, "restart"):
            raise error
        t0 = time.perf_counter()
        while True:  # a rank that dies again during the recovery uses another restart
            if self.restarts >= self.max_restarts:
                if self.max_restarts == 0:
                    raise error
                raise RankFailed(
                    f"{failure}; --max-trainer-restarts {self.max_restarts} used up", rank=failure.rank
                ) from error
            self.restarts += 1
            try:
                resumed, source = self._restart(trainer, rewind, resync)
                break
            except RunError as again:
                if rank_failure(again) is None:
                    raise
                failure = rank_failure(again) or failure  # the summary names the last death
                log.debug("trainer restart %d failed: %s", self.restarts, again)
        elapsed = time.perf_counter() - t0
        replayed = max(rollout_id - resumed, 0)  # completed steps after the checkpoint; step rollout_id never finished
        self.next_id = resumed
        self._metrics = {
            "fault/trainer_restarts": float(self.restarts),
            "fault/steps_replayed": float(replayed),
            "time/trainer_recovery": elapsed,
        }
        log.warning(
            "%s; restarted the trainer (restart %d of %d) from %s, replaying %d completed step(s), in %.1f s",
            failure,
            self.restarts,
            self.max_restarts,
            source,
            replayed,
            elapsed,
        )

    def _restart(self, trainer: Any, rewind: Callable, resync: Callable) -> tuple[int, str]:
        trainer.restart()
        found = self.checkpoint()
        if found is None:
            if self.start != 0 or self.initial_state is None:
                raise RunError(f"no intact checkpoint of this run under {' or '.join(self.dirs) or '--save'}")
            resumed, source = rewind(None, self.initial_state), "the initial weights (no checkpoint yet)"
        else:
            resumed, source = rewind(found[0], None), ckpt.iter_dir(*found)
        resync(resumed)
        return resumed, source
