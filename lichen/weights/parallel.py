"""A thread pool over tensors for the weight code (encode, apply, checksum).

zstd, numpy ufuncs, the compiled kernels, ctypes calls and the hashes release the GIL, so threads over tensors use
every core; torch is kept on one intra-op thread inside each call so the two kinds of parallelism do not stack.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")


# Threads of the weight code per process (encode, apply, checksum pools), where a launcher shares a host's cores
# between processes: each trainer rank's delta encode then runs on its own share (lichen bench sync --runtime ray
# sets 1, so 2 ranks vs 1 on a 2-core machine compares equal per-rank resources).
THREADS_ENV = "LICHEN_WEIGHT_THREADS"


def default_threads() -> int:
    """$LICHEN_WEIGHT_THREADS if set, else the machine's cores, at most 8."""
    want = os.environ.get(THREADS_ENV, "").strip()
    if want:
        if not want.isdigit() or int(want) < 1:
            raise ValueError(f"{THREADS_ENV}={want!r}: expected a whole number of threads, at least 1")
        return int(want)
    return max(1, min(8, os.cpu_count() or 1))


@contextmanager
def serial_torch() -> Iterator[None]:
    """Run torch ops of this thread on one intra-op thread (restored after). The sync code parallelizes over
    tensors itself; torch's own OpenMP team on top of that oversubscribes the cores, and on a busy 2-core
    machine a 1 MiB cast then waits ~100x longer for the team than it computes. The OpenMP setting is per
    thread, so other threads keep theirs."""
    prev = torch.get_num_threads()
    if prev == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def parallel_map(fn: Callable[[T], R], items: Iterable[T], num_threads: int | None = None) -> list[R]:
    """`[fn(x) for x in items]` on a thread pool (in order; plain loop for one thread), torch kept serial inside
    each call (`serial_torch`)."""
    items = list(items)
    threads = min(num_threads or default_threads(), len(items))

    def call(x: T) -> R:
        with serial_torch():
            return fn(x)

    if threads <= 1:
        return [call(x) for x in items]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(call, items))
