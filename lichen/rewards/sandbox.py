"""Running untrusted Python (model-written code) in a sandboxed subprocess.

Each run gets, through the launcher `_sandbox_init.py` (see its docstring for the exact sequence):
- new mount, network, PID, IPC and UTS namespaces: no network at all (not even loopback), a /proc that shows only
  its own processes, and a minimal root of its own: the interpreter, its standard library and shared libraries
  read-only (`sandbox_root.py`), a few devices, and a private size-capped /tmp holding its work directory. No
  host data file, checkout or unix socket is reachable;
- a non-root identity when the trainer is root: a uid/gid of its own (`uid_base + slot`, one slot per concurrent
  run on the host, leased through a lock file in a private directory (`sandbox_lease.py`), so one run's fork bomb
  cannot use up another's process budget),
  no supplementary groups, and no-new-privileges. A non-root trainer gets the same namespaces inside a new user
  namespace instead, the program running as uid 1000 of a nested one;
- a cgroup of its own with the memory limit for all its processes together (`sandbox_cgroup.py`); where none can
  be made, the run's memory is split between a lowered process cap instead, and the trainer's log says so;
- resource limits: CPU seconds, address space, processes, file size, open files, no core dumps;
- an end for all its processes: the launcher hands the trainer a pidfd of the namespace's PID 1, and when the run
  ends (exit, wall-clock timeout, output cap, or the awaiting coroutine being cancelled) the trainer kills it,
  which kills every process of the namespace, then waits until they are gone. Nothing the program does to its
  session, process group or parent-death signal outlives this;
- a cap on captured output: a run that prints more than `max_output_bytes` is killed.
Namespaces alone would not stop a root fork bomb (root ignores RLIMIT_NPROC), and a non-root user alone could
still reach services on loopback; the sandbox needs both, and `check_sandbox` refuses to run without them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import select
import shutil
import signal
import socket
import stat
import sys
import time
from dataclasses import dataclass, field, replace

from lichen.errors import ConfigError
from lichen.rewards.sandbox_cgroup import CgroupParent, RunCgroup, find_cgroup_parent
from lichen.rewards.sandbox_lease import NOBODY, UidLease
from lichen.rewards.sandbox_root import interpreter_paths

logger = logging.getLogger(__name__)

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_init.py")
SETUP_FAILED = 125
DEFAULT_UID_BASE = 2_100_000_000  # far above login and container sub-uid ranges
MAX_UID_BASE = 2**31 - 1 - 256  # base + slot stays a valid positive uid (never -1, which means "unchanged")
LAUNCH_GRACE_S = 0.5
REAP_TIMEOUT_S = 5.0  # how long the trainer waits for a killed sandbox's processes to be gone
FALLBACK_PROCESS_MB = 256  # without a cgroup: the address space each process gets when the run's memory is split


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (not the sandboxed program failing)."""


class SandboxUnavailable(ConfigError):
    """This machine cannot provide the isolation the code reward requires."""


@dataclass
class SandboxLimits:
    timeout_s: float = 5.0  # wall clock for one run
    memory_mb: int = 1024  # RLIMIT_AS
    max_procs: int = 32  # RLIMIT_NPROC (processes and threads of the sandbox uid)
    max_file_mb: int = 16  # RLIMIT_FSIZE
    max_open_files: int = 64
    tmpfs_mb: int = 64  # each private tmpfs (work directory included)
    max_output_bytes: int = 1 << 20  # stdout and stderr, each
    cpu_s: int | None = None  # RLIMIT_CPU; default ceil(timeout_s) + 1
    process_memory_mb: int | None = None  # RLIMIT_AS per process; default memory_mb (the run's, via its cgroup)

    def as_request(self) -> dict:
        per_process = self.process_memory_mb if self.process_memory_mb is not None else self.memory_mb
        return {
            "cpu_s": int(self.cpu_s if self.cpu_s is not None else math.ceil(self.timeout_s) + 1),
            "memory_bytes": int(per_process) << 20,
            "max_procs": int(self.max_procs),
            "max_file_bytes": int(self.max_file_mb) << 20,
            "max_open_files": int(self.max_open_files),
        }


@dataclass
class SandboxResult:
    returncode: int | None  # None when killed by the timeout or the output cap
    stdout: str
    stderr: str
    timed_out: bool = False
    output_limited: bool = False
    elapsed_s: float = 0.0
    details: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.output_limited


@dataclass
class SandboxConfig:
    """Who runs sandboxed code and how; built once by `resolve_sandbox`."""

    python: str
    mode: str  # "root": drop to uid_base + slot; "userns": a user namespace for a non-root trainer
    uid_base: int = DEFAULT_UID_BASE
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    expose: list[str] = field(default_factory=list)  # host paths the minimal root shows, read-only
    cgroup: CgroupParent | None = None  # where each run's cgroup is made; None: the memory is split instead

    def with_limits(self, limits: SandboxLimits) -> "SandboxConfig":
        return SandboxConfig(self.python, self.mode, self.uid_base, limits, self.expose, self.cgroup)


def _world_accessible(path: str) -> bool:
    """Whether a user with no relation to the file's owner can execute `path` (every parent must be o+x)."""
    path = os.path.realpath(path)
    try:
        if not os.stat(path).st_mode & stat.S_IXOTH:
            return False
        parent = os.path.dirname(path)
        while True:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
            if parent == "/":
                return True
            parent = os.path.dirname(parent)
    except OSError:
        return False


def find_python(explicit: str | None, root: bool) -> str:
    """The interpreter for sandboxed code: `explicit`, else this one if the sandbox user can run it, else the
    system python3."""
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise SandboxUnavailable(f"--code-sandbox-python {explicit!r}: not an executable file")
        return explicit
    candidates = [sys.executable, "/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3") or ""]
    for cand in candidates:
        if cand and os.path.isfile(cand) and (not root or _world_accessible(cand)):
            return os.path.realpath(cand)
    raise SandboxUnavailable(
        f"no Python interpreter the sandbox user can run: {sys.executable} lies in a directory other users cannot "
        "enter and there is no /usr/bin/python3; give --code-sandbox-python PATH (an interpreter readable and "
        "executable by all users)"
    )


def resolve_sandbox(
    python: str | None = None, uid_base: int = DEFAULT_UID_BASE, limits: SandboxLimits | None = None
) -> SandboxConfig:
    """Pick the mode for this process, find what the run's root must show and where its cgroup goes, and check,
    by running a probe, that the isolation really holds."""
    root = os.geteuid() == 0
    python = find_python(python, root)
    config = SandboxConfig(
        python=python,
        mode="root" if root else "userns",
        uid_base=uid_base,
        limits=limits or SandboxLimits(),
        expose=interpreter_paths(python),
        cgroup=find_cgroup_parent(),
    )
    if config.cgroup is None:
        config.limits = split_memory(config.limits)
        logger.warning(
            "code sandbox: no cgroup with a memory controller can be made here (%s); each run's %d MiB are "
            "bounded by allowing %d process(es) of %d MiB address space each instead. Run as root or give this "
            "user a delegated cgroup for a per-run memory limit.",
            "not root" if not root else "cgroup file system not writable",
            config.limits.memory_mb,
            config.limits.max_procs,
            config.limits.memory_mb // config.limits.max_procs,
        )
    check_sandbox(config)
    return config


def split_memory(limits: SandboxLimits) -> SandboxLimits:
    """Without a cgroup, RLIMIT_AS holds per process: lower the process cap and the per-process address space so
    that cap x per-process <= the run's memory (each process gets at least FALLBACK_PROCESS_MB when it can)."""
    if limits.memory_mb < 32:
        raise SandboxUnavailable(f"--code-memory-mb {limits.memory_mb}: the interpreter needs at least 32 MiB")
    procs = max(1, min(limits.max_procs, limits.memory_mb // FALLBACK_PROCESS_MB))
    return replace(limits, max_procs=procs, process_memory_mb=limits.memory_mb // procs)


_PROBE = """
import os, socket
print(os.getuid(), os.getpid(), ",".join(sorted(name for _, name in socket.if_nameindex())))
"""


def check_sandbox(config: SandboxConfig) -> dict:
    """Run a probe; raise SandboxUnavailable unless it ran as PID 1 of its namespace with no network interface but
    loopback (and, for a root trainer, as a non-root uid). Falls back to uid 65534 when the uid range is not mapped here."""
    if not 0 < config.uid_base <= MAX_UID_BASE and config.uid_base != NOBODY:
        raise SandboxUnavailable(f"--code-sandbox-uid-base {config.uid_base}: must be in [1, {MAX_UID_BASE}]")
    try:
        result = run_sandboxed_sync(_PROBE, config=config.with_limits(replace(config.limits, timeout_s=10.0)))
    except SandboxError as e:
        if config.mode == "root" and "setresuid" in str(e) and config.uid_base != NOBODY:
            config.uid_base = NOBODY  # e.g. a container whose user namespace maps few uids
            return check_sandbox(config)
        raise SandboxUnavailable(
            f"the code sandbox cannot be set up on this machine: {e}; it needs Linux namespaces (run as root, or "
            "allow unprivileged user namespaces)"
        ) from None
    if not result.ok:
        raise SandboxUnavailable(
            f"the code sandbox does not work on this machine (exit {result.returncode}): "
            f"{(result.stderr or result.stdout).strip()[-400:]}; it needs Linux namespaces (run as root, or allow "
            "unprivileged user namespaces) and a Python the sandbox user can run (--code-sandbox-python)"
        )
    uid, pid, interfaces = result.stdout.split()
    # a fresh network namespace holds only its (downed) loopback interface
    if interfaces != "lo" or pid != "1" or (config.mode == "root" and uid == "0"):
        raise SandboxUnavailable(
            f"the code sandbox probe was not isolated: uid {uid}, pid {pid}, network interfaces {interfaces}"
        )
    return {"uid": int(uid), "mode": config.mode, "python": config.python, "interfaces": interfaces}


async def run_sandboxed(
    source: str, *, config: SandboxConfig, stdin: str = "", files: dict | None = None, argv: list[str] | None = None
) -> SandboxResult:
    """Run `source` (saved as solution.py; `files` are written beside it) with `argv` (default: solution.py).

    Returns its exit code and output; a timeout or output overflow kills the whole sandbox and is reported in
    the result, not raised. Raises SandboxError when the sandbox could not be set up.
    """
    lease = UidLease(config.uid_base)
    while not lease.try_take():  # more concurrent runs on this host than slots: wait for one
        await asyncio.sleep(0.01)
    uid = lease.uid
    cgroup = None
    control, control_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        if config.cgroup is not None:
            RunCgroup.sweep_stale()
            try:
                cgroup = RunCgroup(config.cgroup, config.limits.memory_mb << 20, config.limits.max_procs)
            except OSError as e:  # never run without the limit the sandbox was checked with
                raise SandboxError(f"cannot make this run's cgroup under {config.cgroup.path}: {e}") from None
        request = {
            "files": {"solution.py": source, **(files or {})},
            "argv": argv or ["solution.py"],
            "stdin": stdin,
            "python": config.python,
            "uid": uid,
            "gid": uid,
            "mode": config.mode,
            "tmpfs_mb": config.limits.tmpfs_mb,
            "limits": config.limits.as_request(),
            "expose": config.expose,
            "control_fd": control_child.fileno(),
            "parent_pid": os.getpid(),  # the launcher dies with this process (docs/fault-tolerance.md)
            "cgroup_fd": cgroup.procs_fd if cgroup else None,
        }
        pass_fds = (control_child.fileno(),) + ((cgroup.procs_fd,) if cgroup else ())
        result = await _run_launcher(
            json.dumps(request).encode(), config.limits, pass_fds, control_child, _Namespace(control)
        )
        if cgroup is not None:
            result.details["memory_peak_bytes"] = cgroup.peak_bytes()
    finally:
        control.close()
        control_child.close()
        if cgroup is not None:
            await cgroup.remove()
        lease.release()
    result.details["uid"] = uid
    return result


class _Namespace:
    """The run's PID namespace, held through a pidfd of its PID 1 that the launcher sends once it forked."""

    def __init__(self, control: socket.socket) -> None:
        self.control = control
        self.info: dict = {}

    def kill(self) -> None:
        """Kill PID 1 of the namespace (the kernel then kills all of it) and wait until it is gone.
        A launcher that never forked sent nothing, and has nothing to kill."""
        self.control.setblocking(False)
        try:
            message, fds, _, _ = socket.recv_fds(self.control, 4096, 1)
        except (BlockingIOError, OSError):
            return
        if not fds:
            return
        pidfd = fds[0]
        try:
            self.info = json.loads(message)
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
        try:
            # readable once PID 1 has exited, which it does only after every other process of its namespace
            if not select.select([pidfd], [], [], REAP_TIMEOUT_S)[0]:
                logger.warning(
                    "code sandbox: namespace %s still alive %.0f s after SIGKILL", self.info.get("ns"), REAP_TIMEOUT_S
                )
        finally:
            os.close(pidfd)


async def _run_launcher(
    payload: bytes,
    limits: SandboxLimits,
    pass_fds: tuple[int, ...],
    control_child: socket.socket,
    namespace: _Namespace,
) -> SandboxResult:
    start = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",
        "-S",
        LAUNCHER,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,  # its own process group, killed whole on timeout
        pass_fds=pass_fds,
    )
    control_child.close()  # the launcher holds it now: its end closes when the launcher exits
    overflow = asyncio.Event()
    captured: dict[str, list[bytes]] = {"out": [], "err": []}

    def kill_all() -> None:
        _kill_group(proc.pid)
        namespace.kill()

    async def read_capped(stream: asyncio.StreamReader, key: str) -> None:
        size = 0
        while True:
            chunk = await stream.read(65536)
            if not chunk:
                return
            if size < limits.max_output_bytes:
                captured[key].append(chunk[: limits.max_output_bytes - size])
            size += len(chunk)
            if size > limits.max_output_bytes:
                overflow.set()
                kill_all()

    async def feed() -> None:
        assert proc.stdin is not None
        proc.stdin.write(payload)
        try:
            await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass
        proc.stdin.close()

    assert proc.stdout is not None and proc.stderr is not None
    readers = asyncio.gather(read_capped(proc.stdout, "out"), read_capped(proc.stderr, "err"))
    timed_out = False
    try:
        await feed()
        # the launcher's own start-up (a fresh interpreter, namespaces, mounts: ~50 ms) is not the program's time
        await asyncio.wait_for(asyncio.shield(readers), timeout=limits.timeout_s + LAUNCH_GRACE_S)
        code = await proc.wait()
    except asyncio.TimeoutError:
        timed_out = True
        kill_all()
        code = None
        # what it printed before the kill still counts (e.g. test cases that finished); bounded, since asyncio's
        # wait() returns only once the pipes close, which a process that survived the kill could prevent
        try:
            await asyncio.wait_for(asyncio.gather(proc.wait(), readers), timeout=2.0)
        except asyncio.TimeoutError:
            readers.cancel()
    except BaseException:  # cancelled by the reward runner's own timeout: leave nothing running
        kill_all()
        try:  # reap it and drain its pipes, so they close on this loop rather than at garbage collection
            await asyncio.wait_for(asyncio.gather(proc.wait(), readers), timeout=2.0)
        except BaseException:
            readers.cancel()
        raise
    finally:
        kill_all()  # also after a normal exit: a namespace whose PID 1 lives on is killed here
    out, err = b"".join(captured["out"]), b"".join(captured["err"])
    elapsed = time.perf_counter() - start
    stderr = err.decode(errors="replace")
    if code == SETUP_FAILED and "lichen-sandbox:" in stderr:
        raise SandboxError(stderr.strip().splitlines()[-1])
    limited = overflow.is_set()
    return SandboxResult(
        returncode=None if (timed_out or limited) else code,
        stdout=out.decode(errors="replace"),
        stderr=stderr,
        timed_out=timed_out,
        output_limited=limited,
        elapsed_s=elapsed,
        details={"pid_ns": namespace.info.get("ns")},
    )


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_sandboxed_sync(
    source: str, *, config: SandboxConfig, stdin: str = "", files: dict | None = None, argv: list[str] | None = None
) -> SandboxResult:
    """`run_sandboxed` for synchronous callers (not from inside a running event loop)."""
    return asyncio.run(run_sandboxed(source, config=config, stdin=stdin, files=files, argv=argv))
