"""The one-step off-policy driver (`--async`, slime's train_async.py), beside the synchronous one in lichen/loop.py.

    sync -> [eval] -> for each rollout step k:
        take rollout k -> start generating rollout k+1 (engines at the last pushed version) -> train on k
        -> [save] -> [every --update-weights-interval steps: wait for rollout k+1, sync] -> [eval]

Generation runs on a background thread through the rollout worker's own `generate`, so rollout k+1 is made with
the weights of version k while the trainer trains on rollout k. Before a sync the driver waits for the generation
in flight, so no request straddles a weight update. A checkpoint also waits for it and stores the finished rollout
with the data position (`PipelinedRollout.state_dict`), so a resumed run trains on the same rollout k+1 and then
continues exactly as the uninterrupted one (docs/async.md).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from lichen import sync
from lichen.config.engine_config import ObserveConfig, SyncConfig
from lichen.errors import RunError, UserError
from lichen.loop import (
    eval_before_training,
    is_due,
    resume,
    run_steps,
    save_checkpoint,
    save_due,
    trainer_restarts,
)
from lichen.observe.failed_steps import FailedStepGuard
from lichen.observe.metrics import format_step_line, get_logger
from lichen.observe.progress import print_line, progress
from lichen.observe.run_observer import RunObserver
from lichen.rollout.staleness import staleness_metrics
from lichen.torch_files import to_plain
from lichen.types import Sample

log = get_logger(__name__)

PENDING_KEY = "async_pending"  # the finished, not yet trained rollout inside the rollout state of a checkpoint


class SideError(RunError):
    """An error of one side of an --async run; the message names the side (rollout or trainer) and the step."""


def _on_side(side: str, rollout_id: int, fn: Callable[..., Any], *fn_args: Any) -> Any:
    try:
        return fn(*fn_args)
    except (UserError, SideError, KeyboardInterrupt):
        raise  # a user mistake keeps its one-line message and exit code; an interrupt stays an interrupt
    except Exception as e:
        raise SideError(f"--async: the {side} side failed at rollout step {rollout_id}: {type(e).__name__}: {e}") from e


class PipelinedRollout:
    """The rollout worker with one generation in flight on a background thread; every other attribute (engines,
    args, eval, offload) is the worker's own, so `sync.push`, `loop.resume` and `loop.save_checkpoint` take it
    in the worker's place."""

    def __init__(self, rollout: Any) -> None:
        self.inner = rollout
        self._pending: tuple[int, Future, threading.Thread] | None = None
        self._ready: dict[int, tuple[list[list[Sample]], dict]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def start(self, rollout_id: int) -> None:
        """Begin generating `rollout_id` with the weights the engines serve now."""
        assert self._pending is None, "one generation in flight at a time"
        fut: Future = Future()

        def work() -> None:
            try:
                fut.set_result(_on_side("rollout", rollout_id, self.inner.generate, rollout_id))
            except BaseException as e:  # handed to whoever takes the result; the thread itself ends quietly
                fut.set_exception(e)

        # a daemon thread: after an error on the trainer side the process may exit without waiting for it
        thread = threading.Thread(target=work, name=f"lichen-async-rollout-{rollout_id}", daemon=True)
        self._pending = (rollout_id, fut, thread)
        thread.start()

    def wait(self) -> None:
        """Let the generation in flight finish; its result is kept for `take`."""
        if self._pending is not None:
            rollout_id, fut, _ = self._pending
            self._pending = None
            self._ready[rollout_id] = fut.result()

    def take(self, rollout_id: int) -> tuple[list[list[Sample]], dict]:
        """Rollout `rollout_id`: the one finished or in flight, else generated now."""
        if rollout_id not in self._ready:
            if self._pending is None:
                self.start(rollout_id)
            if self._pending[0] != rollout_id:
                raise RuntimeError(f"rollout {self._pending[0]} is in flight, not {rollout_id}")
            self.wait()
        return self._ready.pop(rollout_id)

    def in_flight(self) -> int | None:
        return self._pending[0] if self._pending is not None else None

    def state_dict(self) -> dict:
        """The worker's state after the generation in flight, and that rollout itself (it is trained after the
        checkpoint's step; its prompts are already spent in the data position)."""
        self.wait()
        state = dict(self.inner.state_dict())
        state[PENDING_KEY] = {
            str(k): {"groups": to_plain([[s.to_dict() for s in g] for g in groups]), "metrics": to_plain(metrics)}
            for k, (groups, metrics) in self._ready.items()
        }
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpoint's state (--load, or a trainer restart's rewind): the generation in flight, if any,
        finishes first, since it consumes the data position this replaces; its rollout is dropped."""
        self.wait()
        state = dict(state)
        pending = state.pop(PENDING_KEY, {})
        self.inner.load_state_dict(state)
        self._ready = {
            int(k): ([[Sample.from_dict(d) for d in g] for g in v["groups"]], dict(v["metrics"]))
            for k, v in pending.items()
        }

    def abandon(self) -> None:
        """After an error: nobody takes the generation in flight; its daemon thread ends when the engines
        answer or are stopped (loop.run closes them)."""
        self._pending = None
        self._ready.clear()


def _begin(args, trainer, rollout, logger, obs: RunObserver) -> tuple[int, SyncConfig, dict]:
    """Resume, push the starting weights, eval version 0: (first rollout id, sync config, eval metrics or {})."""
    start = resume(args, trainer, rollout)
    sync_cfg = SyncConfig.from_args(args)
    with obs.phase("sync", start - 1):
        sync.push(trainer, rollout, version=start, cfg=sync_cfg)
    last: dict = {}
    if args.eval_interval and start == 0 and not args.skip_eval_before_train:
        last = eval_before_training(args, rollout, logger, obs)
    return start, sync_cfg, last


def _log_step(args, trainer, logger, obs: RunObserver, rollout_id: int, batch: list, metrics: dict, t0: float) -> dict:
    metrics["time/step"] = time.perf_counter() - t0
    obs.step_done(rollout_id + 1, batch, metrics, trainer.token_values)
    logger.log(rollout_id + 1, metrics)
    print_line(format_step_line(rollout_id, {**metrics, "num_rollout": args.num_rollout}))
    return metrics


def train_loop_async(args, trainer, rollout, logger, observer: RunObserver | None = None) -> dict:
    """`lichen train --async`: the loop of the module docstring; same arguments and result as loop.train_loop."""
    obs = observer or RunObserver(ObserveConfig.from_args(args))
    pipe = PipelinedRollout(rollout)
    all_failed = FailedStepGuard(args.max_consecutive_failed_steps)
    try:
        start, sync_cfg, last = _begin(args, trainer, pipe, logger, obs)
        restarts = trainer_restarts(args, pipe, start)

        def step(rollout_id: int) -> dict:
            return _async_step(args, trainer, pipe, logger, obs, sync_cfg, all_failed, restarts, rollout_id)

        last = run_steps(args, trainer, pipe, restarts, sync_cfg, step, last)
    except BaseException:
        pipe.abandon()
        raise
    return last


def _async_step(args, trainer, pipe, logger, obs, sync_cfg, all_failed, restarts, rollout_id: int) -> dict:
    """One step of the --async loop; its metrics (with those of a trainer restart just before it)."""
    t0 = time.perf_counter()
    with obs.phase("generate", rollout_id):  # how long the trainer waits for the rollout
        batch, metrics = pipe.take(rollout_id)
    metrics.update(restarts.take_metrics())
    all_failed.check(rollout_id, batch)
    if rollout_id + 1 < args.num_rollout:
        pipe.start(rollout_id + 1)  # with the weights the engines serve now: one version behind at most
    metrics.update(staleness_metrics(batch, rollout_id))
    with obs.phase("train", rollout_id):
        metrics.update(_on_side("trainer", rollout_id, trainer.train, rollout_id, batch))
    if save_due(args, rollout_id):
        with obs.phase("save", rollout_id) as rec:
            save_checkpoint(args, trainer, pipe, rollout_id)  # waits for the rollout in flight
        metrics["time/save"] = rec.elapsed()
    if is_due(args.update_weights_interval, rollout_id, args.num_rollout):
        with obs.phase("generate", rollout_id):
            pipe.wait()  # no request straddles the weight update
        with obs.phase("sync", rollout_id):
            metrics.update(sync.push(trainer, pipe, version=rollout_id + 1, cfg=sync_cfg))
    if is_due(args.eval_interval, rollout_id, args.num_rollout):
        with obs.phase("eval", rollout_id):
            metrics.update(pipe.eval(version=rollout_id + 1))
    return _log_step(args, trainer, logger, obs, rollout_id, batch, metrics, t0)


def train_loop_fully_async(args, trainer, rollout, logger, observer: RunObserver | None = None) -> dict:
    """`lichen train --fully-async`: the worker of lichen.rollout.fully_async generates all the time; each step
    takes --rollout-batch-size finished groups, trains, and pauses the worker (its requests aborted and re-queued)
    for the checkpoint, the weight sync and the eval that fall on it. Same arguments and result as
    loop.train_loop."""
    from lichen.rollout.fully_async import FullyAsyncRollout

    obs = observer or RunObserver(ObserveConfig.from_args(args))
    worker = FullyAsyncRollout(rollout, max_staleness=args.max_staleness, stale_action=args.max_staleness_action)
    all_failed = FailedStepGuard(args.max_consecutive_failed_steps)
    try:
        start, sync_cfg, last = _begin(args, trainer, worker, logger, obs)
        for rollout_id in progress(range(start, args.num_rollout), desc="rollout", disable=args.no_progress):
            t0 = time.perf_counter()
            worker.resume()  # (re)started after the sync: what it sends now runs with the weights just pushed
            with obs.phase("generate", rollout_id):  # how long the trainer waits for finished groups
                batch, metrics = _on_side("rollout", rollout_id, worker.take, rollout_id)
            all_failed.check(rollout_id, batch)
            with obs.phase("train", rollout_id):
                metrics.update(_on_side("trainer", rollout_id, trainer.train, rollout_id, batch))
            save = save_due(args, rollout_id)
            syncs = is_due(args.update_weights_interval, rollout_id, args.num_rollout)
            evals = is_due(args.eval_interval, rollout_id, args.num_rollout)
            if save or syncs or evals:
                with obs.phase("generate", rollout_id):
                    _on_side("rollout", rollout_id, worker.pause)  # nothing runs on the engines from here
            if save:
                with obs.phase("save", rollout_id) as rec:
                    save_checkpoint(args, trainer, worker, rollout_id)
                metrics["time/save"] = rec.elapsed()
            if syncs:
                with obs.phase("sync", rollout_id):
                    metrics.update(sync.push(trainer, worker, version=rollout_id + 1, cfg=sync_cfg))
            if evals:
                with obs.phase("eval", rollout_id):
                    metrics.update(worker.eval(version=rollout_id + 1))
            last = _log_step(args, trainer, logger, obs, rollout_id, batch, metrics, t0)
    finally:
        worker.stop()  # aborts what still runs, before loop.run closes the engines
    return last
