"""Stops the Ray instance a `lichen train` started when that driver dies without stopping it (SIGKILL, OOM kill).

Ray stops most of a local instance when its driver dies (GCS, raylet and workers fate-share with it), but not all:
with ray 2.60 the dashboard agent and the runtime-env agent were still running 30 s after a `kill -9` of the
driver, re-parented to init. So the driver that starts Ray also starts this reaper (`start_reaper`), a separate
process in its own session that waits, blocked on a pipe only the driver holds:

- the driver writes `done` (RayCluster.close, after ray.shutdown): the reaper exits, touching nothing;
- the pipe ends without `done` (the driver died: the kernel closed its end), or the reaper's parent is no longer
  the driver (it died while a child it forked, which inherits every descriptor, still holds the pipe open): the
  reaper SIGTERMs every process carrying the driver's own marker (LICHEN_RUN_INSTANCE, fresh in every
  `lichen train` and inherited from it by every process of the Ray instance it started, lichen.lifetime; not
  LICHEN_RUN_ID, which a user may have exported in the shell), waits up to `GRACE_S`, SIGKILLs the rest, and
  sweeps again until none has been left for `SETTLE_S` (a dying raylet can start an agent again after the first
  sweep), at most `LIMIT_S`; then it exits.

Only an instance lichen started gets a reaper: in a cluster the run joined, nothing of Ray is stopped; Ray itself
kills the run's actors there (they are not detached: an actor's owner dying ends it), and the engine servers those
actors started die with them (their parent-death signal).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from typing import IO

from lichen.lifetime import RUN_ID_ENV, RUN_INSTANCE_ENV, run_processes

GRACE_S = 5.0
SETTLE_S = 2.0
LIMIT_S = 20.0
POLL_S = 0.5
DONE = b"done"


def start_reaper() -> IO[bytes] | None:
    """Start the reaper of this process' run (needs LICHEN_RUN_INSTANCE: `lichen train` sets it); returns the pipe
    to hand to `stop_reaper`, or None when the process carries no run marker."""
    instance = os.environ.get(RUN_INSTANCE_ENV)
    if not instance:
        return None
    proc = subprocess.Popen(
        [sys.executable, "-m", "lichen.cluster.ray_reaper", instance, str(os.getpid())],
        stdin=subprocess.PIPE,
        start_new_session=True,  # not in the driver's process group: a Ctrl-C there must not end it first
    )
    assert proc.stdin is not None
    return proc.stdin


def stop_reaper(pipe: IO[bytes] | None) -> None:
    """The driver stopped its Ray itself: the reaper exits without touching anything."""
    if pipe is None:
        return
    try:
        pipe.write(DONE)
        pipe.close()
    except OSError:  # the reaper is gone already
        pass


def reap(instance: str, grace: float = GRACE_S, settle: float = SETTLE_S, limit: float = LIMIT_S) -> int:
    """SIGTERM, then after `grace` s SIGKILL, every process of the driver instance `instance` but this one, again
    until none has been found for `settle` s (or `limit` s have passed); returns how many there were."""

    def others() -> list[int]:
        return [p for p in run_processes(instance, RUN_INSTANCE_ENV) if p != os.getpid()] + orphaned_agents()

    found: set[int] = set()
    stop = time.monotonic() + limit
    quiet_since = time.monotonic()
    while time.monotonic() < stop:
        pids = others()
        if not pids:
            if time.monotonic() - quiet_since >= settle:
                break
            time.sleep(0.1)
            continue
        found.update(pids)
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 0.0)):
            for pid in others():
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            end = time.monotonic() + wait
            while time.monotonic() < end and others():
                time.sleep(0.1)
        quiet_since = time.monotonic()
    return len(found)


def orphaned_agents() -> list[int]:
    """Ray processes (`ray::...`) of this run (LICHEN_RUN_ID) left without a parent (re-parented to init). Ray's
    dashboard and runtime-env agents sometimes start with an environment that lacks LICHEN_RUN_INSTANCE (seen in 1
    of 5 kill -9 runs), so the instance marker alone misses them; an agent of a live run has its raylet as parent,
    so only a dead instance's agents match."""
    run_id = os.environ.get(RUN_ID_ENV)
    if not run_id:
        return []
    found = []
    for pid in run_processes(run_id, RUN_ID_ENV):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                name = f.read()
            with open(f"/proc/{pid}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[-1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if name.startswith(b"ray::") and ppid == 1 and pid != os.getpid():
            found.append(pid)
    return found


def wait_for_driver(pipe: IO[bytes], driver: int, poll: float = POLL_S) -> bool:
    """Block until the driver says `done` (True) or dies (False): its end of `pipe` closed, or this process's
    parent is no longer `driver`."""
    fd = pipe.fileno()
    got = b""
    while True:
        ready, _, _ = select.select([fd], [], [], poll)
        if ready:
            chunk = os.read(fd, 64)
            if not chunk:
                return got.startswith(DONE)
            got += chunk
            if got.startswith(DONE):
                return True
        elif os.getppid() != driver:
            return False


def main(argv: list[str]) -> int:
    instance, driver = argv[0], int(argv[1])
    if wait_for_driver(sys.stdin.buffer, driver):
        return 0
    reap(instance)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
