"""Every process a run starts ends with it, even when `lichen train` is killed with SIGKILL (no cleanup runs then),
and carries the run's marker (docs/fault-tolerance.md#driver-death).

- The marker: `lichen train` sets LICHEN_RUN_ID (a fresh uuid, or the one it was started with) in its own
  environment before it starts anything, so every process it starts (engine servers, sandbox launchers, the Ray
  instance it starts and that instance's workers) inherits it; /proc/<pid>/environ shows it, so a test or an
  operator lists a run's processes by it (`run_processes`), not by name.
- Dying with the parent: the launchers start every child through `die_with_parent(argv)`, a small wrapper that
  sets the parent-death signal (Linux prctl PR_SET_PDEATHSIG = SIGTERM) and then execs the command, and they
  start it from one long-lived thread (`spawn`): the kernel sends the signal when the *thread* that forked the
  child ends, so a restart started from a short-lived worker thread would otherwise lose it (why the launchers
  used it from the main thread only). The wrapper also exits at once when its parent is already gone.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import sys
import threading
import uuid
from typing import Callable, TypeVar

T = TypeVar("T")

RUN_ID_ENV = "LICHEN_RUN_ID"
# Always fresh, one per `lichen train` process: what the Ray reaper kills by. LICHEN_RUN_ID may come from the
# user's environment (an exported one marks their shell too), this one only from the driver.
RUN_INSTANCE_ENV = "LICHEN_RUN_INSTANCE"
_RUN_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def mark_run() -> str:
    """This process' run marker: LICHEN_RUN_ID as given (letters, digits, `_.-`, at most 64), else a new uuid;
    set in os.environ so that every child inherits it, with a fresh LICHEN_RUN_INSTANCE. Returns the run id."""
    given = os.environ.get(RUN_ID_ENV, "")
    run_id = given if _RUN_ID.fullmatch(given) else uuid.uuid4().hex
    os.environ[RUN_ID_ENV] = run_id
    os.environ[RUN_INSTANCE_ENV] = uuid.uuid4().hex
    return run_id


# Runs in the child before the command: die with the parent (argv[1] = its pid), then become the command.
_PDEATHSIG_WRAPPER = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]): sys.exit(1)  # the parent is already gone\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)
_spawner: concurrent.futures.ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def die_with_parent(argv: list[str]) -> list[str]:
    """`argv` (an executable path first) wrapped so the process gets SIGTERM when this one dies (Linux; elsewhere
    `argv` as it is). Start it with `spawn`."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-c", _PDEATHSIG_WRAPPER, str(os.getpid()), *argv]


def spawn(start: Callable[[], T]) -> T:
    """Run `start` (which starts a child process) on the process' spawner thread, which lives until the
    interpreter exits, and return what it returns (or raise what it raised)."""
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lichen-spawner")
        spawner = _spawner
    return spawner.submit(start).result()


def run_processes(run_id: str, variable: str = RUN_ID_ENV) -> list[int]:
    """The pids of live processes whose environment carries `variable`=`run_id` (LICHEN_RUN_ID by default;
    Linux, readable ones only). Zombies (exited, not yet reaped) are not counted: they hold nothing."""
    want = f"{variable}={run_id}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[-1].split()[0]
        except OSError:
            continue
        if want in env and state != b"Z":
            found.append(int(name))
    return found
