"""`--watchdog-timeout S`: notice a phase that hangs, and leave the evidence in the run directory.

A daemon thread looks at the phases running now (lichen.observe.phases). When the oldest has run longer than the
timeout it writes `<output_dir>/watchdog/hang_<time>_<k>_<phase>.txt` (k: timeouts passed):

- the phases running, innermost last, with rollout id, process rank, thread and how long each has run
  (e.g. `generate > reward`), and the engines serving the rollout;
- every thread's stack of this process (faulthandler);
- each engine server's stacks, as its `GET /debug/stacks` answers (lichen serve), or why none came.

When the same phase is still running after a second timeout, the run exits with EXIT_CODE, unless `wait` is set
(--watchdog-wait), in which case it keeps waiting and dumps again after each further timeout.
"""

from __future__ import annotations

import faulthandler
import os
import re
import sys
import threading
import time
import traceback
from typing import Callable

from lichen.observe.metrics import get_logger
from lichen.observe.phases import PhaseRecord, PhaseTracker
from lichen.observe.phases import tracker as default_tracker

log = get_logger(__name__)

WATCHDOG_DIR = "watchdog"
EXIT_CODE = 3  # distinct from user errors (2) and run errors (1): the run hung


def thread_stacks() -> str:
    """Every thread's Python stack, by thread name (what `lichen serve` answers at GET /debug/stacks)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"Thread {names.get(ident, '?')!r} ({ident}):\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


def describe(active: list[PhaseRecord], now: float, rank: int = 0) -> list[str]:
    """One line per running phase, outermost first."""
    return [
        f"  {r.name}"
        + (f" (rollout {r.step})" if r.step is not None else "")
        + f": rank {rank}, thread {r.thread_name!r}, running {now - r.start:.1f} s"
        + (f", {r.args}" if r.args else "")
        for r in active
    ]


class Watchdog:
    """See the module docstring. `engine_stacks()` returns {engine address: its stacks or why none came}."""

    def __init__(
        self,
        output_dir: str,
        timeout: float,
        *,
        wait: bool = False,
        rank: int = 0,
        engine_stacks: Callable[[], dict[str, str]] | None = None,
        phases: PhaseTracker | None = None,
        exit_fn: Callable[[int], None] = os._exit,
        poll: float | None = None,
    ) -> None:
        self.output_dir, self.timeout, self.wait, self.rank = output_dir, float(timeout), wait, rank
        self.engine_stacks = engine_stacks
        self.phases = phases or default_tracker()
        self.exit_fn = exit_fn
        self.poll = poll if poll is not None else min(5.0, max(0.05, self.timeout / 10))
        self.dumps: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_dump: dict[int, int] = {}  # id of the oldest phase record -> timeouts already reported

    def start(self) -> "Watchdog":
        self._thread = threading.Thread(target=self._run, name="lichen-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> "Watchdog":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            self.check()

    def check(self, now: float | None = None) -> str | None:
        """Dump once per timeout the oldest running phase has passed; exit after the second one unless `wait`."""
        active = self.phases.active()
        if not active:
            return None
        now = now or time.time()
        oldest = active[0]
        timeouts = int(oldest.elapsed(now) // self.timeout)
        if timeouts < 1 or self._last_dump.get(id(oldest), 0) >= timeouts:
            return None
        self._last_dump = {id(oldest): timeouts}
        path = self.dump(active, now, timeouts)
        if timeouts >= 2 and not self.wait:
            log.error(
                "watchdog: phase %s still running after %.0f s (2 x --watchdog-timeout): exiting with code "
                "%d; stacks in %s (--watchdog-wait keeps waiting instead)",
                " > ".join(r.name for r in active),
                now - oldest.start,
                EXIT_CODE,
                path,
            )
            self.exit_fn(EXIT_CODE)
        return path

    def dump(self, active: list[PhaseRecord], now: float, timeouts: int = 1) -> str:
        inner = active[-1]
        chain = " > ".join(r.name for r in active)
        folder = os.path.join(self.output_dir, WATCHDOG_DIR)
        os.makedirs(folder, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now))
        path = os.path.join(folder, f"hang_{stamp}_{timeouts}_{re.sub(r'[^A-Za-z0-9_.-]', '_', inner.name)}.txt")
        engines = self._engine_stacks()
        with open(path, "w", encoding="utf-8") as f:
            f.write(
                f"lichen watchdog: phase {chain} has run longer than --watchdog-timeout {self.timeout:g} s "
                f"(pid {os.getpid()}, rank {self.rank})\n\nrunning phases (outermost first):\n"
            )
            f.write("\n".join(describe(active, now, self.rank)) + "\n")
            f.write(f"engines: {', '.join(engines) if engines else 'in-process (their threads are below)'}\n")
            f.write("\n---- stacks of every thread of this process (faulthandler) ----\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
            for address, text in engines.items():
                f.write(f"\n---- engine {address}: stacks ----\n{text.rstrip()}\n")
        self.dumps.append(path)
        log.warning(
            "watchdog: phase %s (rollout %s) has run %.1f s, longer than --watchdog-timeout %g s: stacks written to %s",
            chain,
            inner.step,
            now - active[0].start,
            self.timeout,
            path,
        )
        return path

    def _engine_stacks(self) -> dict[str, str]:
        if self.engine_stacks is None:
            return {}
        try:
            return self.engine_stacks()
        except Exception as e:  # the dump of this process must not depend on the engines answering
            return {"engines": f"could not ask the engines for their stacks: {type(e).__name__}: {e}"}
