"""Trainer rank processes that outlive `ray.kill` on the driver's host: SIGKILLed after a grace period.

`ray.kill` asks Ray to end an actor's worker process; it returns at once and the process ends when its raylet gets
to it. Once, under a load of 14 on 2 cores, two rank processes were still alive 60 s after their group was torn
down (tests/test_ray_rank_killed_in_sync.py, not reproduced since). A rank that survives its group holds its
memory, and on a GPU its device memory, until someone kills it. The driver knows each rank's pid and the process's
start time (`RayTrainGroup.where`), so a sweep after `GRACE_S` SIGKILLs the ones still alive on the driver's own
host. The start time (field 22 of /proc/PID/stat, clock ticks since boot) must match, so a pid the kernel has
since given to another process is never signalled. Ranks on other hosts are left to Ray.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from lichen.observe.metrics import get_logger

log = get_logger(__name__)

GRACE_S = 20.0  # ray.kill's own work first: on a quiet host a killed worker is gone within a second
POLL_S = 0.5


def start_time(pid: int) -> int | None:
    """The start time of process `pid` (clock ticks since boot), None when there is no such process (Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[-1].split()
    except OSError:
        return None
    # after "pid (comm)": field 3 is the state, field 22 the start time; a zombie holds nothing
    return None if fields[0] == b"Z" else int(fields[19])


def survivors(procs: list[tuple[int, int]]) -> list[int]:
    """The pids of `procs` ((pid, start time)) that are still the same live process."""
    return [pid for pid, started in procs if start_time(pid) == started]


def kill_survivors(procs: list[tuple[int, int]]) -> list[int]:
    """SIGKILL every process of `procs` still alive; returns their pids."""
    killed = []
    for pid in survivors(procs):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return killed


def sweep_later(procs: list[tuple[int, int]], grace: float = GRACE_S, what: str = "trainer rank") -> threading.Thread:
    """A daemon thread that waits up to `grace` s for `procs` to end, then SIGKILLs the ones still alive (and
    logs it); returns the thread, started."""

    def sweep() -> None:
        end = time.monotonic() + grace
        while survivors(procs) and time.monotonic() < end:
            time.sleep(POLL_S)
        killed = kill_survivors(procs)
        if killed:
            log.warning("%s process(es) %s outlived ray.kill by %.0f s: killed", what, killed, grace)

    thread = threading.Thread(target=sweep, name="lichen-rank-sweep", daemon=True)
    thread.start()
    return thread
