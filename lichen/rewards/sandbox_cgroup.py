"""A cgroup per sandboxed run, so that its memory limit holds for all its processes together.

`find_cgroup_parent` looks, once, for a place this trainer may create cgroups with a memory controller: under its
own cgroup in the cgroup v2 hierarchy (`memory.max`, plus `pids.max` and `memory.swap.max` where present), else
under its own cgroup of the v1 memory hierarchy (`memory.limit_in_bytes` and, with swap accounting,
`memory.memsw.limit_in_bytes`). As root both usually work; an unprivileged trainer needs a delegated cgroup
(systemd `Delegate=yes`), else there is none and the sandbox falls back to splitting the run's memory between a
lowered process cap (see `sandbox.py`). The sandbox's PID 1 joins the run's cgroup by writing to a
`cgroup.procs` fd the trainer opened, so the program never sees the cgroup file system.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from dataclasses import dataclass

_counter = itertools.count()


@dataclass(frozen=True)
class CgroupParent:
    version: int  # 1 or 2
    path: str  # the directory under which run cgroups are made


def _own_cgroups() -> dict[str, str]:
    """controller (or "" for v2) -> this process's cgroup path."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                out[name] = path
    return out


def _mounts() -> list[tuple[str, str, list[str]]]:
    """(mount point, fstype, super options) of every cgroup mount."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, right = line.split(" - ", 1)
            fstype, _, options = right.split()[:3]
            if fstype in ("cgroup", "cgroup2"):
                out.append((left.split()[4], fstype, options.split(",")))
    return out


def _try_parent(version: int, path: str) -> CgroupParent | None:
    probe = os.path.join(path, f"lichen-sandbox-probe-{os.getpid()}-{next(_counter)}")
    try:
        os.mkdir(probe)
    except OSError:
        return None
    try:
        limit_file = "memory.max" if version == 2 else "memory.limit_in_bytes"
        with open(os.path.join(probe, limit_file), "w") as f:
            f.write(str(64 << 20))
        return CgroupParent(version, path)
    except OSError:
        return None
    finally:
        try:
            os.rmdir(probe)
        except OSError:
            pass


def find_cgroup_parent() -> CgroupParent | None:
    """Where this process can make memory-limited cgroups, or None."""
    try:
        own, mounts = _own_cgroups(), _mounts()
    except OSError:
        return None
    for point, fstype, _ in mounts:
        if fstype == "cgroup2" and "" in own:
            found = _try_parent(2, point + own[""])
            if found:
                return found
    for point, fstype, options in mounts:
        if fstype == "cgroup" and "memory" in options and "memory" in own:
            found = _try_parent(1, point + own["memory"])
            if found:
                return found
    return None


class RunCgroup:
    """One run's cgroup: made with its limits, joined through `procs_fd`, removed after the run."""

    def __init__(self, parent: CgroupParent, memory_bytes: int, max_procs: int) -> None:
        self.path = os.path.join(parent.path, f"lichen-sandbox-{os.getpid()}-{next(_counter)}")
        os.mkdir(self.path)
        try:
            if parent.version == 2:
                self._write("memory.max", memory_bytes)
                self._write("memory.swap.max", 0, optional=True)
                self._write("pids.max", max_procs, optional=True)
            else:
                self._write("memory.limit_in_bytes", memory_bytes)
                self._write("memory.memsw.limit_in_bytes", memory_bytes, optional=True)
            self.procs_fd = os.open(os.path.join(self.path, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)
        except BaseException:
            os.rmdir(self.path)
            raise

    def _write(self, name: str, value: int, optional: bool = False) -> None:
        try:
            with open(os.path.join(self.path, name), "w") as f:
                f.write(str(value))
        except OSError:
            if not optional:
                raise

    def peak_bytes(self) -> int | None:
        for name in ("memory.peak", "memory.max_usage_in_bytes"):
            try:
                with open(os.path.join(self.path, name)) as f:
                    return int(f.read())
            except (OSError, ValueError):
                continue
        return None

    async def remove(self) -> None:
        """Close the fd and remove the cgroup once its (already killed) processes are reaped."""
        if self.procs_fd >= 0:
            os.close(self.procs_fd)
            self.procs_fd = -1
        for _ in range(100):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:  # EBUSY while the last zombies are reaped
                await asyncio.sleep(0.02)
        _stale.append(self.path)

    @staticmethod
    def sweep_stale() -> None:
        for path in list(_stale):
            try:
                os.rmdir(path)
            except FileNotFoundError:
                pass
            except OSError:
                continue
            _stale.remove(path)


_stale: list[str] = []
