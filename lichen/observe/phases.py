"""Named phases of a run (generate, reward, train, sync, eval, save): who is in which phase since when, how long
each took, and the memory each used.

One process-wide `PhaseTracker` (`tracker()`) is fed by `with phase("train", step=3):` blocks. It keeps

- the phases running now, for the hang watchdog (lichen.observe.watchdog), which names them in its dump;
- the finished ones, as slices for the trace (lichen.observe.trace);
- for phases opened with `memory=True` (the loop's top-level ones), the peak resident memory (CPU) and the
  peak CUDA allocation during the phase, as `memory/<phase>_peak_rss_gb` and
  `memory/<phase>_cuda_max_allocated_gb` in the step's metrics. Such a phase first gives the heap that earlier
  phases freed back to the OS (`release_free_heap`): every lichen process does at the loop's phase starts.

A phase may be entered from any thread and concurrently (rewards run many calls at once); each entry is its own
record. Nested memory phases are not supported (the peak counters are process-wide), so only the loop's
non-overlapping phases measure memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import resource
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

_GB = 1024**3
_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"
# The largest VmHWM read just before a reset: resetting VmHWM also lowers the kernel's lifetime peak (the
# ru_maxrss a parent's wait4 reports), so the process keeps the lifetime peak itself (`lifetime_peak_rss_bytes`).
_peak_before_resets = 0


@dataclass
class PhaseRecord:
    """One entry into a phase. `end` is None while it runs."""

    name: str
    step: int | None  # the rollout id the phase works for (-1: before the first step), None: not known
    start: float  # time.time() seconds
    thread_id: int
    thread_name: str
    args: dict = field(default_factory=dict)
    end: float | None = None

    def elapsed(self, now: float | None = None) -> float:
        return (self.end if self.end is not None else (now or time.time())) - self.start


def _reset_peak_rss() -> bool:
    """Linux: writing 5 to clear_refs resets the process' peak RSS (VmHWM) to its current RSS; the peak it
    replaces is kept for `lifetime_peak_rss_bytes`."""
    global _peak_before_resets
    _peak_before_resets = max(_peak_before_resets, peak_rss_bytes())
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """The peak resident set size: VmHWM since its last reset on Linux, else the process' lifetime peak."""
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def lifetime_peak_rss_bytes() -> int:
    """The process' peak resident set since it started, across `reset_peaks` calls (which lower the kernel's own
    lifetime counter, ru_maxrss, to the peak since the last reset)."""
    return max(_peak_before_resets, peak_rss_bytes())


def _cuda() -> Any:
    """torch.cuda when torch is loaded and CUDA was initialised by the run; never imports torch itself."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return torch.cuda if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    except Exception:  # a broken driver must not break the run's bookkeeping
        return None


@functools.cache
def _malloc_trim() -> Any:
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return None


def release_free_heap() -> None:
    """Give the pages of freed heap memory back to the OS (glibc's `malloc_trim(0)`; nothing where the C library
    has none: musl, macOS). glibc keeps what a process frees for its later allocations, and with its adaptive
    mmap threshold even large tensors come from that heap after a while: without this, the phase after a train
    step runs on top of the step's freed activations, and the process' footprint only grows."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def reset_peaks() -> bool:
    """A memory phase starts in this process: freed heap goes back to the OS first (`release_free_heap`, so the
    phase's peak is its own, not the last phase's leftovers on top of it), then the peak counters are reset (RSS;
    CUDA's where the run initialised it). False where the peak RSS cannot be reset (then `read_peaks` gives the
    lifetime peak, which still bounds the phase's)."""
    release_free_heap()
    cuda = _cuda()
    if cuda is not None:
        cuda.reset_peak_memory_stats()
    return _reset_peak_rss()


def read_peaks(rss_reset: bool = True) -> dict[str, float]:
    """This process' peaks since `reset_peaks`: {"peak_rss_gb": …} and, on CUDA, "cuda_max_allocated_gb"; with
    "peak_rss_is_lifetime": 1 when the RSS counter was not reset."""
    found = {"peak_rss_gb": peak_rss_bytes() / _GB}
    if not rss_reset:
        found["peak_rss_is_lifetime"] = 1
    cuda = _cuda()
    if cuda is not None:
        found["cuda_max_allocated_gb"] = cuda.max_memory_allocated() / _GB
    return found


class PhaseTracker:
    """Thread-safe record of the phases of this process (see the module docstring)."""

    def __init__(self, keep: int = 100_000) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._active: dict[int, PhaseRecord] = {}
        self._done: list[PhaseRecord] = []
        self._keep = keep  # finished records kept for the trace; the oldest go first
        self.memory: dict[str, float] = {}  # metrics of the memory phases since the last take_memory()

    def begin(self, name: str, step: int | None = None, **args: Any) -> int:
        """Start a phase that does not fit a `with` block (e.g. a scheduler's busy period); `end(key)` ends it."""
        t = threading.current_thread()
        if step is None:  # a phase inside another (a reward call inside generate) works for the same rollout
            step = next((r.step for r in self.active() if r.step is not None), None)
        rec = PhaseRecord(name, step, time.time(), t.ident or 0, t.name, dict(args))
        with self._lock:
            key = next(self._ids)
            self._active[key] = rec
        return key

    def end(self, key: int) -> PhaseRecord:
        with self._lock:
            rec = self._active.pop(key)
            rec.end = time.time()
            self._done.append(rec)
            if len(self._done) > self._keep:
                del self._done[: len(self._done) - self._keep]
        return rec

    @contextlib.contextmanager
    def phase(self, name: str, step: int | None = None, *, memory: bool = False, **args: Any) -> Iterator[PhaseRecord]:
        rss_reset = reset_peaks() if memory else False
        key = self.begin(name, step, **args)
        try:
            yield self._active[key]
        finally:
            self.end(key)
            if memory:
                # (the phase may have initialised CUDA: read_peaks looks again)
                found = {f"memory/{name}_{k}": v for k, v in read_peaks(rss_reset).items()}
                with self._lock:
                    self.memory.update(found)

    def active(self) -> list[PhaseRecord]:
        """The phases running now, oldest first."""
        with self._lock:
            return sorted(self._active.values(), key=lambda r: r.start)

    def finished(self, since: float | None = None) -> list[PhaseRecord]:
        """The finished phases kept (the newest `keep`); with `since`, those that ended after it."""
        with self._lock:
            return [r for r in self._done if since is None or (r.end or 0) > since]

    def take_memory(self) -> dict[str, float]:
        """The memory metrics gathered since the last call (the loop adds them to the step's metrics)."""
        with self._lock:
            out, self.memory = self.memory, {}
        return out


_TRACKER = PhaseTracker()


def tracker() -> PhaseTracker:
    return _TRACKER


def phase(name: str, step: int | None = None, *, memory: bool = False, **args: Any):
    """`with phase("reward"):` on the process-wide tracker."""
    return _TRACKER.phase(name, step, memory=memory, **args)
