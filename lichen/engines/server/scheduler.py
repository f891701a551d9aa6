"""The step loop behind `lichen serve`: one thread owns the engine and runs continuous batching.

Between two decode steps the thread takes in what arrived: new sequences go to the waiting queue and join the
running batch at the next step (a finished one leaves it at once); control calls (abort, pause, weight updates,
memory release) run there too, so nothing ever touches the model while a forward pass is running.

Exclusive calls (weight updates) follow SGLang's reader/writer lock: while the engine is not paused they wait
until the running batch has drained, and no waiting sequence is admitted meanwhile; while paused they run at once.

Results leave through `on_events(progress, done)`, called from this thread after every iteration:
`progress` lists (seq, n_tokens) for sequences that stream, `done` the sequences that finished.
"""

from __future__ import annotations

import concurrent.futures
import threading
import traceback
from collections import deque
from typing import Any, Callable

from lichen.engines.core.decode_batch import Seq
from lichen.engines.core.engine import Engine
from lichen.observe.metrics import get_logger
from lichen.observe.phases import phase, tracker

log = get_logger(__name__)

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class SchedulerError(Exception):
    """A control call that cannot be done in the engine's current state (reported as HTTP 400)."""


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        *,
        max_running: int,
        on_events: Callable[[list[tuple[Seq, int]], list[Seq]], None],
        stop_text: Callable[[Seq], str | None] | None = None,
    ):
        self.engine = engine
        self.batch = engine.new_batch(stop_text)
        self.max_running = max_running
        self.on_events = on_events
        self.waiting: deque[Seq] = deque()
        self.paused = False
        self.released: set[str] = set()
        self.generated_tokens = 0  # since start; /v1/loads derives a throughput from it
        self._cv = threading.Condition()
        self._inbox: list[tuple] = []
        self._exclusive: list[tuple[Callable, concurrent.futures.Future]] = []
        self._stopping = False
        self._skipped = 0
        self._progress: list[tuple[Seq, int]] = []
        self._done: list[Seq] = []
        self._busy: int | None = None  # the phase record of the current busy period (lichen.observe.phases)
        self._thread = threading.Thread(target=self._run, name="lichen-scheduler", daemon=True)

    # ---- called from other threads ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def submit(self, seqs: list[Seq]) -> None:
        self._put(("submit", seqs))

    def call(self, fn: Callable[["Scheduler"], Any], *, exclusive: bool = False) -> concurrent.futures.Future:
        """Run fn(self) on the scheduler thread between steps; the future holds its result or exception."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._put(("call", fn, fut, exclusive))
        return fut

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything (callers get their partial output) and end the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _put(self, item: tuple) -> None:
        with self._cv:
            self._inbox.append(item)
            self._cv.notify()

    # ---- state (read on any thread) ------------------------------------------------------------------------
    # Published by the scheduler thread after each pass (_publish): other threads read these ints and never the
    # batch or the queue themselves, which change under them (len() of a batch mid-update once failed a request).
    num_running = 0
    num_waiting = 0
    cache_tokens = 0
    waiting_tokens = 0

    def _publish(self) -> None:
        self.num_running = len(self.batch)
        self.num_waiting = len(self.waiting)
        self.cache_tokens = self.batch.cache_tokens
        self.waiting_tokens = sum(len(s.input_ids) + len(s.output_ids) for s in self.waiting)

    def idle(self) -> bool:
        return not len(self.batch) and not self.waiting

    # ---- control operations (run on the scheduler thread via `call`) --------------------------------------
    def abort(self, seqs: list[Seq] | None, message: str, status_code: int | None = None) -> int:
        """Abort the given sequences (None: all) wherever they are; returns how many were aborted."""
        version = self.engine.weight_version
        chosen = None if seqs is None else {id(s) for s in seqs}
        hit_wait = [s for s in self.waiting if chosen is None or id(s) in chosen]
        if hit_wait:
            self.waiting = deque(s for s in self.waiting if chosen is not None and id(s) not in chosen)
            for s in hit_wait:
                # A retracted one has output: it keeps it, and the message says where it was aborted.
                s.finish = ("abort", "Abort in waiting queue", status_code)
                s.finish_version = s.versions[-1][0] if s.versions else version
        hit_run = [s for s in self.batch.live() if chosen is None or id(s) in chosen]
        self.batch.abort(hit_run, message, version)
        if status_code is not None:
            for s in hit_run:
                s.finish = ("abort", message, status_code)
        self._done += hit_wait + hit_run
        self._emit()  # before the caller hears back, so aborted requests are answered first
        return len(hit_wait) + len(hit_run)

    def pause(self, mode: str) -> None:
        """abort: abort everything; retract: running sequences go back to the front of the waiting queue (their
        cache is dropped and recomputed on continue); in_place: the batch stays as it is. All modes stop steps."""
        self.paused = True
        if mode == "abort":
            self.abort(None, "Abort by pause_generation")
        elif mode == "retract":
            self.waiting.extendleft(reversed(self.batch.retract()))

    def resume(self) -> None:
        self.paused = False

    def release(self, tags: list[str] | None) -> None:
        tags = list(MEMORY_TAGS) if tags is None else tags
        if not self.idle():
            raise SchedulerError(
                f"cannot release memory with {self.num_running} running and {self.num_waiting} waiting request(s); "
                "pause generation (mode abort) or abort them first"
            )
        again = [t for t in tags if t in self.released]
        if again:
            raise SchedulerError(f"memory tag(s) {again} already released")
        self.engine.offload(tags)
        self.released.update(tags)

    def resume_memory(self, tags: list[str] | None) -> None:
        tags = sorted(self.released) if tags is None else tags
        missing = [t for t in tags if t not in self.released]
        if missing:
            raise SchedulerError(f"memory tag(s) {missing} not currently released")
        self.engine.onload(tags)
        self.released.difference_update(tags)

    # ---- the loop -----------------------------------------------------------------------------------------
    def _can_generate(self) -> bool:
        return not self.paused and not self.released

    def _ready(self) -> bool:
        if self._exclusive and (self.paused or not len(self.batch)):
            return True
        return self._can_generate() and (bool(self.waiting) or bool(len(self.batch)))

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._inbox and not self._ready() and not self._stopping:
                    self._cv.wait()
                items, self._inbox = self._inbox, []
                stopping = self._stopping
            for item in items:
                if item[0] == "submit":
                    self.waiting.extend(item[1])
                else:
                    _, fn, fut, exclusive = item
                    if exclusive:
                        self._exclusive.append((fn, fut))
                    else:
                        self._call(fn, fut)
            if stopping:
                self.abort(None, "server is shutting down")
                for _fn, fut in self._exclusive:
                    fut.set_exception(SchedulerError("server is shutting down"))
                self._emit()
                return
            while self._exclusive and (self.paused or not len(self.batch)):
                with phase("update weights"):  # exclusive calls are the weight updates; a slice of the trace
                    self._call(*self._exclusive.pop(0))
            if self._can_generate() and (self.waiting or len(self.batch)):
                if self._busy is None:  # one trace slice per busy period, from the first request to idle
                    self._busy = tracker().begin("generate")
                try:
                    self._iterate()
                except Exception as e:  # never leave callers hanging: fail what was running, keep serving
                    log.error("engine step failed:\n%s", traceback.format_exc())
                    self.abort([s for s in self.batch.live()], f"engine error: {type(e).__name__}: {e}", 500)
                    self.batch = self.engine.new_batch(self.batch.stop_text)
            if self._busy is not None and not (self._can_generate() and (self.waiting or len(self.batch))):
                tracker().end(self._busy)
                self._busy = None
            self._emit()

    def _call(self, fn: Callable, fut: concurrent.futures.Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            result = fn(self)
        except BaseException as e:  # the caller re-raises it
            self._publish()
            fut.set_exception(e)
        else:
            self._publish()  # before the caller hears back: what it reads next reflects its call
            fut.set_result(result)

    def _iterate(self) -> None:
        version = self.engine.weight_version
        free = self.max_running - len(self.batch)
        if self.waiting and free > 0 and not self._exclusive:
            # Each join rebuilds the cache (about one step's cost): join when the batch is empty, when the
            # newcomers are worth it, or when they have waited a few steps.
            if not len(self.batch) or len(self.waiting) * 8 >= len(self.batch) or self._skipped >= 4:
                take = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
                self._skipped = 0
                try:
                    self._done += self.batch.add(take, version)
                except Exception as e:  # a bad newcomer must not take the running batch down with it
                    log.error("prefill failed:\n%s", traceback.format_exc())
                    for s in take:
                        if s.finish is None:
                            s.finish = ("abort", f"engine error: {type(e).__name__}: {e}", 500)
                            s.finish_version = version
                    self._done += take
            else:
                self._skipped += 1
        streaming = [s for s in self.batch.rows if s.finish is None and getattr(s.tag, "stream", False)]
        finished = self.batch.step(version)
        self.generated_tokens += len(finished) + len(self.batch)
        self._done += finished
        self._progress += [(s, len(s.output_ids)) for s in streaming if s.finish is None]

    def _emit(self) -> None:
        self._publish()
        if self._progress or self._done:
            progress, done = self._progress, self._done
            self._progress, self._done = [], []
            try:
                self.on_events(progress, done)
            except Exception:
                log.error("event delivery failed:\n%s", traceback.format_exc())
