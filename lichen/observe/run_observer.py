"""What a `lichen train` run records besides its metrics: phases with their memory, the sample log, the trace and
the hang watchdog, behind one object the loop calls.

    obs = RunObserver(cfg, engines=rollout.engines, decode=tokenizer.decode,   # cfg: ObserveConfig
                      sources=[trainer])                                   # more processes for the trace
    with obs.phase("train", rollout_id):                    # every top-level phase of the loop
        ...
    obs.step_done(step, batch, metrics, token_values)       # adds memory/* metrics, writes samples and trace
    obs.close()

Engine servers that can (lichen serve, through RemoteEngines) give their stacks to the watchdog and their own
phases to the trace; so do the other `sources` (the Ray runtime's trainer ranks): anything with
`debug_trace(since) -> {key: trace_payload}` gives the trace one process per key.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable, Iterator, Sequence

from lichen.observe.engine_memory import engine_memory_sources
from lichen.observe.phases import PhaseRecord, PhaseTracker, tracker
from lichen.observe.sample_log import SampleLog
from lichen.observe.trace import (
    REMOTE_PID_BASE,
    TRACE_FILE,
    records_from_payload,
    remote_lanes,
    trace_events,
    write_trace,
)
from lichen.observe.watchdog import Watchdog
from lichen.types import Sample

MAX_ENGINE_RECORDS = 100_000  # per engine, the oldest go first


class RunObserver:
    def __init__(
        self,
        cfg: Any,
        *,
        engines: Sequence[Any] = (),
        decode: Callable[[list[int]], str] | None = None,
        phases: PhaseTracker | None = None,
        sources: Sequence[Any] = (),
    ) -> None:
        self.cfg = cfg
        self.phases = phases or tracker()
        self.t0 = time.time()
        self.samples = SampleLog(cfg.output_dir, cfg.log_samples, reward_key=cfg.reward_key, decode=decode)
        self.engine_trace = _callables([*engines, *sources], "debug_trace")
        # other processes' peak memory per phase (memory/rank{r}/..., memory/engine{i}/...), until step_done
        self.memory_sources = [s for s in sources if callable(getattr(s, "memory_begin", None))]
        self.memory_sources += engine_memory_sources(engines)
        self._other_memory: dict[str, float] = {}
        self.engine_records: dict[str, list[PhaseRecord]] = {}
        self.engine_pids: dict[str, int] = {}
        self.process_names: dict[str, str] = {}
        self._engine_since = self.t0
        self.watchdog = (
            Watchdog(
                cfg.output_dir,
                cfg.watchdog_timeout,
                wait=cfg.watchdog_wait,
                engine_stacks=engine_stacks_of(engines),
                phases=self.phases,
            ).start()
            if cfg.watchdog_timeout > 0
            else None
        )

    @contextlib.contextmanager
    def phase(self, name: str, step: int | None = None) -> Iterator[PhaseRecord]:
        """A top-level phase of the loop: timed for the trace, watched, and its peak memory measured, the driver's
        and that of every other process that can tell (`memory_begin`/`memory_end`: trainer ranks, engines)."""
        for source in self.memory_sources:
            source.memory_begin()
        try:
            with self.phases.phase(name, step, memory=True) as rec:
                yield rec
        finally:
            for source in self.memory_sources:
                self._other_memory.update(source.memory_end(name))

    def step_done(
        self,
        step: int,
        batch: Sequence[Sequence[Sample]] | None,
        metrics: dict,
        token_values: Callable[[list[int]], dict] | dict | None = None,
    ) -> None:
        """After the loop's step `step` (the step number of metrics.jsonl): adds the memory metrics of its phases
        to `metrics`, logs its samples (`token_values`: the trainer's, lichen.observe.sample_log), rewrites the
        trace."""
        metrics.update(self.phases.take_memory())
        metrics.update(self._other_memory)
        self._other_memory = {}
        if batch is not None:
            self.samples.write(step, batch, token_values)
        self.write_trace()

    def _fetch_engine_records(self) -> None:
        """The other processes' phases finished since the last fetch; one without a rollout id (the engines do
        not know them) gets the id of the innermost driver phase it started in."""
        mine = [r for r in self.phases.finished(self._engine_since - 60) if r.step is not None]
        newest = self._engine_since
        for ask in self.engine_trace:
            for url, payload in ask(self._engine_since).items():
                records = self.engine_records.setdefault(url, [])
                seen = {(r.start, r.thread_id, r.name) for r in records[-1000:]}
                for r in records_from_payload(payload):
                    if (r.start, r.thread_id, r.name) in seen:
                        continue
                    if r.step is None:  # e.g. the driver's generate (or eval) a busy period served
                        r.step = max(
                            ((m.start, m.step) for m in mine if m.start <= r.start <= (m.end or r.start)),
                            default=(0, None),
                            key=lambda x: x[0],
                        )[1]
                    records.append(r)
                del records[:-MAX_ENGINE_RECORDS]
                self.engine_pids[url] = int(payload.get("pid", 0))
                self.process_names[url] = str(payload.get("process_name") or f"lichen serve {url}")
                newest = max(newest, float(payload.get("now", newest)))
        self._engine_since = newest

    def write_trace(self) -> None:
        if not self.cfg.trace:
            return
        if self.engine_trace:
            self._fetch_engine_records()
        own, remote = remote_lanes(r for r in self.phases.finished() if r.start >= self.t0)
        ranks_apart = any(n.startswith("trainer rank") for n in self.process_names.values())
        events = trace_events(
            own,
            t0=self.t0,
            pid=os.getpid(),
            process_name="lichen train (driver)" if ranks_apart else "lichen train (driver, rank 0)",
        )
        for url, records in self.engine_records.items():
            events += trace_events(
                [r for r in records if r.start >= self.t0],
                t0=self.t0,
                pid=self.engine_pids[url],
                process_name=self.process_names[url],
            )
        for k, (name, records) in enumerate(sorted(remote.items())):
            events += trace_events(
                records, t0=self.t0, pid=REMOTE_PID_BASE + k, process_name=f"{name} (requests as the driver timed them)"
            )
        write_trace(os.path.join(self.cfg.output_dir, TRACE_FILE), events)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        self.write_trace()


def _callables(engines: Sequence[Any], method: str) -> list[Callable]:
    return [getattr(e, method) for e in engines if callable(getattr(e, method, None))]


def engine_stacks_of(engines: Sequence[Any]) -> Callable[[], dict[str, str]] | None:
    """For the watchdog: the stacks of engine servers, from engines that can ask theirs (RemoteEngines'
    `debug_stacks`); None when the engines run in this process (their threads are in this process' dump)."""
    askers = _callables(engines, "debug_stacks")
    if not askers:
        return None

    def ask() -> dict[str, str]:
        out: dict[str, str] = {}
        for asker in askers:
            out.update(asker())
        return out

    return ask
