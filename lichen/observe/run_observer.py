"""What a `lichen train` run records besides its metrics: phases with their memory, the sample log, the trace and
the hang watchdog, behind one object the loop calls.

    obs = RunObserver(cfg, engine_stacks=..., decode=...)   # cfg: ObserveConfig
    with obs.phase("train", rollout_id):                    # every top-level phase of the loop
        ...
    obs.step_done(rollout_id, batch, metrics, token_values) # adds memory/* metrics, writes samples and trace
    obs.close()
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Sequence

from lichen.observe.phases import PhaseTracker, tracker
from lichen.observe.sample_log import SampleLog
from lichen.observe.trace import TRACE_FILE, trace_events, write_trace
from lichen.observe.watchdog import Watchdog
from lichen.types import Sample


class RunObserver:
    def __init__(self, cfg: Any, *, engine_stacks: Callable[[], dict[str, str]] | None = None,
                 decode: Callable[[list[int]], str] | None = None, phases: PhaseTracker | None = None) -> None:
        self.cfg = cfg
        self.phases = phases or tracker()
        self.t0 = time.time()
        self.samples = SampleLog(cfg.output_dir, cfg.log_samples, reward_key=cfg.reward_key, decode=decode)
        self.watchdog = (Watchdog(cfg.output_dir, cfg.watchdog_timeout, wait=cfg.watchdog_wait,
                                  engine_stacks=engine_stacks, phases=self.phases).start()
                         if cfg.watchdog_timeout > 0 else None)

    def phase(self, name: str, step: int | None = None):
        """A top-level phase of the loop: timed for the trace, watched, and its peak memory measured."""
        return self.phases.phase(name, step, memory=True)

    def step_done(self, step: int, batch: Sequence[Sequence[Sample]] | None, metrics: dict,
                  token_values: dict | None = None) -> None:
        """After the loop's step `step` (the step number of metrics.jsonl): adds the memory metrics of its phases
        to `metrics`, logs its samples, rewrites the trace."""
        metrics.update(self.phases.take_memory())
        if batch is not None:
            self.samples.write(step, batch, token_values)
        self.write_trace()

    def write_trace(self) -> None:
        if self.cfg.trace:
            events = trace_events(self.phases.finished(), t0=self.t0, pid=os.getpid(),
                                  process_name="lichen train (driver, rank 0)")
            write_trace(os.path.join(self.cfg.output_dir, TRACE_FILE),
                        [e for e in events if e.get("ph") == "M" or e["ts"] >= 0])

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        self.write_trace()


def engine_stacks_of(engines: Sequence[Any]) -> Callable[[], dict[str, str]] | None:
    """For the watchdog: the stacks of engine servers, from engines that can ask theirs (RemoteEngines'
    `debug_stacks`); None when the engines run in this process (their threads are in this process' dump)."""
    askers = [e.debug_stacks for e in engines if callable(getattr(e, "debug_stacks", None))]
    if not askers:
        return None

    def ask() -> dict[str, str]:
        out: dict[str, str] = {}
        for asker in askers:
            out.update(asker())
        return out

    return ask
