"""Fully asynchronous rollout (`--fully-async`, docs/async.md): a long-lived worker keeps the engines busy.

slime runs this as a rollout-function plug-in with a global background worker (examples/fully_async); lichen
wraps its rollout worker (`RolloutManager`) instead, so the engines, data source, rewards and checkpoint state are
the ones every run has. A daemon thread starts one group at a time (a prompt's --n-samples-per-prompt requests, or
a group held in the data source's partial buffer, continued first) while fewer than --over-sampling-batch-size
groups are on the engines and fewer than two --rollout-batch-size are finished or on the engines. A group whose
requests are all back is scored, shaped and, with --dynamic-sampling-filter-path, filtered: kept groups join the
ready buffer, rejected ones are counted and dropped (their prompts are spent, as in dynamic sampling).

The trainer `take`s --rollout-batch-size ready groups per step. A group whose oldest segment is more than
`max_staleness` versions behind the trainer is dropped (replaced by the next one) or kept with a zero loss mask
(`stale_action` "drop" / "mask"), counted in the step's metrics.

Before a weight sync, a checkpoint or an eval the driver calls `pause()`: the worker sends nothing more, aborts
what runs on the engines (lichen.rollout.abort_surplus.drain, repeated until every request has answered) and puts
every unfinished group, with its partial tokens, back into the partial buffer (lichen.rollout.partial), so no
request runs across a weight update: each response segment is one request served by one weight version, recorded
in `Sample.weight_versions` (`metadata["partial_rollout_segments"]` holds the segment lengths). `resume()` lets
it continue. A checkpoint (taken while paused) holds the data position, the partial buffer, the ready groups and
the prompt counters, so a resumed run loses and repeats no prompt.

A group's seed key is its start number (`serial`, saved too): sample j of a group started as number k samples
with derive_seed(--seed, k, 0, j); a continued group gets a new number, as a new round would.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from typing import Any

from lichen.engines.core.sampler import derive_seed
from lichen.observe.metrics import get_logger
from lichen.rollout.abort_surplus import Gate, can_abort, drain, member_sample, result_or_none
from lichen.rollout.context import active
from lichen.rollout.filters import load_group_filter, renumber_groups, run_group_filter
from lichen.rollout.manager import dump_rollout, rollout_metrics
from lichen.rollout.partial import continuation_request
from lichen.rollout.samples import sample_requests, score, shape
from lichen.rollout.shaping import overlong_metrics
from lichen.rollout.staleness import group_lag, staleness_metrics
from lichen.torch_files import to_plain
from lichen.types import Sample

log = get_logger(__name__)

STATE_KEY = "fully_async"  # the worker's own part of the rollout state in a checkpoint
STALE_ACTIONS = ("drop", "mask")
# cumulative prompt accounting (saved): consumed = trained + filtered + stale_dropped + held (ready, partial)
TOTALS = ("consumed", "trained", "filtered", "stale_dropped", "stale_masked")


class _Flight:
    """A group on the engines: per member (request index or None, ("resumed", Sample) | ("fresh", owner))."""

    def __init__(self, members: list[tuple[int | None, tuple]], futures: list) -> None:
        self.members, self.futures = members, futures

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def complete(self, results: list) -> bool:
        """Every request sent and answered without an abort (else the group is continued later)."""
        return all(
            res is not None and res.finish_reason != "abort"
            for (k, _), res in zip(self.members, results)
            if k is not None
        )

    def results(self, tolerant: bool) -> list:
        get = result_or_none if tolerant else (lambda f: f.result())
        return [None if k is None else get(self.futures[k]) for k, _ in self.members]


class FullyAsyncRollout:
    """The rollout worker `inner` (a RolloutManager) driven by a background thread; every attribute it does not
    define (engines, args, eval, close) is the inner worker's, so `lichen.sync.push`, `loop.resume` and
    `loop.save_checkpoint` take it in the worker's place."""

    def __init__(self, inner: Any, *, max_staleness: int | None = None, stale_action: str = "drop") -> None:
        if stale_action not in STALE_ACTIONS:
            raise ValueError(f"stale_action must be one of {STALE_ACTIONS}, not {stale_action!r}")
        self.inner = inner
        ctx = inner.context
        cfg = ctx.config
        if not can_abort(cfg, ctx.engine):
            raise RuntimeError("--fully-async needs engine servers whose requests lichen makes and can abort")
        self._ctx, self._cfg, self._source = ctx, cfg, inner.data_source
        self.max_staleness, self.stale_action = max_staleness, stale_action
        self._batch = cfg.data.batch_size
        self._on_engines_cap = cfg.over_sampling_batch_size
        self._ahead_cap = 2 * cfg.data.batch_size
        path = cfg.dynamic_sampling_filter_path
        self._filter = load_group_filter(path) if path else None
        self._ready: deque[list[Sample]] = deque()
        self._flights: list[_Flight] = []
        self._gate: Gate | None = None
        self.serial = 0
        self.totals: Counter = Counter()
        self._step: Counter = Counter()  # since the last take: filtered, stale_dropped, stale_masked, aborted...
        self._cv = threading.Condition()
        self._mode = "pause"  # what the driver asks for: "run", "pause" or "stop"
        self._paused = True  # what the worker thread does: True while it sends nothing
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    # ---- control, from the driver's thread ----------------------------------------------------------------------
    def resume(self) -> None:
        """Start or continue generating with the weights the engines serve now."""
        with self._cv:
            self._raise_error()
            self._mode = "run"
            self._cv.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="lichen-fully-async-rollout", daemon=True)
            self._thread.start()

    def pause(self) -> None:
        """Return once nothing runs on the engines: unfinished groups are back in the partial buffer."""
        with self._cv:
            if self._thread is None:
                return
            self._mode = "pause"
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._paused or self._error is not None)
            self._raise_error()

    def stop(self, timeout: float = 300.0) -> None:
        """End the worker thread (its requests aborted); after an error too. `timeout` only bounds the join."""
        with self._cv:
            self._mode = "stop"
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def take(self, rollout_id: int) -> tuple[list[list[Sample]], dict]:
        """--rollout-batch-size ready groups for training step `rollout_id` (the trainer's version), after the
        staleness rule; waits for the worker when fewer are ready."""
        t0 = time.perf_counter()
        out: list[list[Sample]] = []
        with self._cv:
            while len(out) < self._batch:
                self._cv.wait_for(lambda: self._ready or self._error is not None or self._mode != "run")
                self._raise_error()
                if not self._ready:
                    raise RuntimeError("take() while the fully async worker is not running: nothing would arrive")
                group = self._ready.popleft()
                self._cv.notify_all()  # room for another group
                lag = group_lag(group, rollout_id)
                if self.max_staleness is not None and lag is not None and lag > self.max_staleness:
                    self._count("stale_dropped" if self.stale_action == "drop" else "stale_masked")
                    if self.stale_action == "drop":
                        continue
                    for s in group:
                        s.loss_mask = [0] * s.response_length
                out.append(group)
            self.totals["trained"] += len(out)
            step, self._step = self._step, Counter()
            ready, held = len(self._ready), len(self._source.buffer)
        renumber_groups(out)
        metrics = rollout_metrics(out, self._cfg.reward.reward_key)
        metrics.update(staleness_metrics(out, rollout_id))
        metrics.update(overlong_metrics(s for g in out for s in g))
        metrics.update(
            {
                "rollout/fully_async_ready_groups": ready,
                "rollout/partial_buffer_groups": held,
                "rollout/fully_async_stale_dropped": step["stale_dropped"],
                "rollout/fully_async_stale_masked": step["stale_masked"],
                "rollout/fully_async_aborted_requests": step["aborted_requests"],
                "rollout/fully_async_requeued_groups": step["requeued"],
                "time/reward": step["reward_time"],
                "time/generate": time.perf_counter() - t0,
            }
        )
        if self._filter is not None:
            metrics["rollout/dynamic_sampling_dropped_groups"] = step["filtered"]
            metrics["rollout/dynamic_sampling_passed_groups"] = step["passed"]
        if self._cfg.save_debug_rollout_data:
            dump_rollout(self._cfg.save_debug_rollout_data, rollout_id, out)
        return out, metrics

    def generate(self, rollout_id: int) -> tuple[list[list[Sample]], dict]:
        return self.take(rollout_id)

    # ---- checkpoint state (taken while paused) --------------------------------------------------------------------
    def state_dict(self) -> dict:
        with self._cv:
            if not self._paused:
                raise RuntimeError("FullyAsyncRollout.state_dict() needs the worker paused (pause() first)")
            state = dict(self.inner.state_dict())  # data position + the partial buffer
            state[STATE_KEY] = {
                "ready": to_plain([[s.to_dict() for s in g] for g in self._ready]),
                "serial": self.serial,
                "totals": dict(self.totals),
            }
        return state

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        mine = state.pop(STATE_KEY, None) or {}
        partial = state.get("partial_rollout")
        # the manager drops held groups without --partial-rollout; here they are always continued
        self.inner.load_state_dict({**state, "partial_rollout": None})
        self._source.buffer.load_state_dict(partial)
        self._ready = deque([Sample.from_dict(d) for d in g] for g in mine.get("ready", []))
        self.serial = int(mine.get("serial", 0))
        self.totals = Counter(mine.get("totals", {}))

    # ---- the worker thread --------------------------------------------------------------------------------------
    def _loop(self) -> None:
        with active(self._ctx):  # reward and filter plug-ins may call lichen.rollout.context.current()
            self._run()

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(self._has_work)
                    mode = self._mode
                    if mode == "run":
                        self._paused = False
                if mode != "run":
                    self._cut()
                    with self._cv:
                        self._paused = True
                        self._cv.notify_all()
                        if mode == "stop":
                            return
                        self._cv.wait_for(lambda: self._mode != "pause")
                        self._paused = self._mode == "stop"
                    continue
                self._collect()
                self._launch()
        except BaseException as e:  # handed to the driver by take/pause; the thread itself ends quietly
            with self._cv:
                self._error = e
                self._cv.notify_all()
            try:
                self._cut(tolerant=True)
            except BaseException:  # noqa: BLE001 - the first error is the one reported
                log.debug("fully async: cleanup after an error failed", exc_info=True)
        finally:
            with self._cv:
                self._paused = True
                self._cv.notify_all()

    def _has_work(self) -> bool:
        return self._mode != "run" or any(f.done() for f in self._flights) or self._room()

    def _room(self) -> bool:
        return len(self._flights) < self._on_engines_cap and len(self._flights) + len(self._ready) < self._ahead_cap

    def _wake(self, _future: Any = None) -> None:
        with self._cv:
            self._cv.notify_all()

    def _launch(self) -> None:
        """Start groups while there is room: held (partial) groups first, then new prompts."""
        ctx, sampling = self._ctx, self._cfg.sampling
        engine = ctx.engine
        if self._gate is None:  # one gate per segment: cut at the next pause
            self._gate = Gate(engine)
        while True:
            with self._cv:
                if self._mode != "run" or not self._room():
                    return
            key, self.serial = self.serial, self.serial + 1
            held = self._source.buffer.take_all()
            requests, members = [], []
            if held:
                for rest in held[1:]:
                    self._source.buffer.put(rest)
                for j, s in enumerate(held[0]):
                    req = continuation_request(sampling, s, seed=derive_seed(sampling.seed, key, 0, j))
                    if req is not None:
                        requests.append(req)
                    members.append((len(requests) - 1 if req is not None else None, ("resumed", s)))
            else:
                prompts = self._source.get_prompts(1)
                self.totals["consumed"] += 1
                requests, owners = sample_requests(sampling, prompts, ctx.encode, seed_key=key)
                members = [(k, ("fresh", owner)) for k, owner in enumerate(owners)]
            futures = [engine.submit(self._gate.generate(r)) for r in requests]
            flight = _Flight(members, futures)
            with self._cv:
                self._flights.append(flight)
            for f in futures:
                f.add_done_callback(self._wake)

    def _collect(self) -> None:
        """Finish every group whose requests are all back."""
        for flight in [f for f in self._flights if f.done()]:
            with self._cv:
                self._flights.remove(flight)
            results = flight.results(tolerant=False)  # a failed request fails the rollout side
            if not flight.complete(results):
                self._requeue(flight, results)  # aborted by someone else (an engine restart): continue it later
            else:
                self._finish(
                    [member_sample(self._ctx, base, res, False) for (_, base), res in zip(flight.members, results)]
                )

    def _finish(self, group: list[Sample]) -> None:
        stats = score(self._ctx, group)
        shape(self._cfg, group)
        keep = True
        if self._filter is not None:
            keep = run_group_filter(self._filter, self._ctx.args, [group], self._cfg.dynamic_sampling_filter_path)[0]
        with self._cv:
            self._step["reward_time"] += stats["reward_time_s"]
            if keep:
                self._step["passed"] += 1
                self._ready.append(group)
            else:
                self._step["filtered"] += 1
                self.totals["filtered"] += 1
            self._cv.notify_all()

    def _requeue(self, flight: _Flight, results: list) -> None:
        self._source.buffer.put(
            [member_sample(self._ctx, base, res, True) for (_, base), res in zip(flight.members, results)]
        )
        with self._cv:
            self._step["requeued"] += 1

    def _cut(self, tolerant: bool = False) -> None:
        """Abort what runs on the engines; finished groups are finished, the others go back to the buffer in the
        order they were started."""
        flights, self._flights = list(self._flights), []
        gate, self._gate = self._gate, None
        if not flights:
            return
        futures = [f for fl in flights for f in fl.futures]
        aborted = drain(self._ctx.engine, futures, gate) if gate is not None else 0
        with self._cv:
            self._step["aborted_requests"] += aborted
        for flight in flights:
            results = flight.results(tolerant=True)
            if flight.complete(results) and not tolerant:
                self._finish(
                    [member_sample(self._ctx, base, res, False) for (_, base), res in zip(flight.members, results)]
                )
            else:
                self._requeue(flight, results)

    def _count(self, key: str) -> None:
        self._step[key] += 1
        self.totals[key] += 1

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error
