"""The sandbox holds against these attacks, with the trainer as root and as nobody:
- an escaped process (no parent-death signal, its own session) dies with its run;
- the memory limit holds for all of a run's processes together;
- the program sees a minimal root: no data file, no checkout, no unix socket of the host."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import time

import pytest
from helpers.sandbox_as_user import CAN_DROP, run_as_nobody

from lichen.rewards.sandbox import SandboxLimits, resolve_sandbox, run_sandboxed_sync, split_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux namespaces")

UID_BASE = 2_000_000_000 + ((os.getpid() + 250) % 1000) * 256
MEMORY_MB = 256
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the trainer-as-root variant needs root")
as_nobody = pytest.mark.skipif(not CAN_DROP, reason="needs root (to drop to nobody), setpriv and /usr/bin/python3")


@pytest.fixture(scope="module")
def sandbox():
    return resolve_sandbox(uid_base=UID_BASE, limits=SandboxLimits(timeout_s=20.0, memory_mb=MEMORY_MB, max_procs=16))


# an escape: clear the parent-death signal, leave the session, fork more of the same, sleep
ESCAPE = """
import ctypes, os, sys, time
libc = ctypes.CDLL(None)
def escape():
    libc.prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG = 0
    try:
        os.setsid()
    except OSError:
        pass
escape()
for _ in range(8):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        escape()
        time.sleep(300)
        os._exit(0)
print(os.readlink("/proc/self/ns/pid"), flush=True)
time.sleep(300)
"""

# 8 processes each holding 100 MiB (touched) under a 256 MiB run; prints their total resident memory in MiB
MEMORY_HOG = """
import os
r, w = os.pipe()
for _ in range(8):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        os.close(r)
        try:
            held = b"x" * (100 << 20)
        except MemoryError:
            os._exit(1)
        os.write(w, b"1")
        os.close(w)
        import time
        time.sleep(300)
os.close(w)
while os.read(r, 1):  # EOF once every child holds its memory or died
    pass
total_kb = 0
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open("/proc/%s/status" % pid) as f:
            total_kb += sum(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except OSError:
        pass
print(total_kb // 1024)
"""

# what a program can reach of the host: argv[1] a data file, argv[2] a unix socket, argv[3] the checkout
SNOOP = """
import json, os, socket, sys
data, sock, checkout = %r, %r, %r
out = {"root": sorted(os.listdir("/"))}
try:
    out["data"] = open(data).read()
except OSError as e:
    out["data"] = type(e).__name__
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sock)
    s.sendall(b"hello")
    out["socket"] = "connected"
except OSError as e:
    out["socket"] = type(e).__name__
out["checkout"] = os.path.exists(checkout)
out["passwd"] = os.path.exists("/etc/passwd")
print(json.dumps(out))
"""

FORBIDDEN_TOP = {"etc", "home", "root", "var", "work", "run", "srv", "opt", "mnt", "media", "sys", "boot"}


def namespace_members(ns: str) -> list[str]:
    """Host PIDs of live (non-zombie) processes in PID namespace `ns` ("pid:[inode]")."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") != ns:
                continue
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(pid)
        except OSError:
            continue
    return found


def assert_namespace_gone(ns: str) -> None:
    assert ns.startswith("pid:["), ns
    time.sleep(1.0)  # nothing of that namespace may be left 1 s after the run returned
    left = namespace_members(ns)
    for pid in left:  # do not leave them running if the test fails
        try:
            os.kill(int(pid), 9)
        except OSError:
            pass
    assert left == []


@pytest.fixture()
def host_secrets():
    """A world-readable data file, a world-connectable unix socket (outside /tmp, which was always covered)."""
    base = next(d for d in ("/var/lib", "/opt", "/run", "/srv") if os.path.isdir(d) and os.access(d, os.W_OK))
    folder = tempfile.mkdtemp(prefix="lichen-sandbox-secrets-", dir=base)
    os.chmod(folder, 0o755)
    data = os.path.join(folder, "train.jsonl")
    with open(data, "w") as f:
        f.write('{"output": "HIDDEN-ANSWER"}')
    os.chmod(data, 0o644)
    listener = socket.socket(socket.AF_UNIX)
    path = os.path.join(folder, "service.sock")
    listener.bind(path)
    os.chmod(path, 0o777)
    listener.listen(4)
    checkout = os.path.abspath(__file__)
    try:
        yield data, path, checkout
    finally:
        listener.close()
        shutil.rmtree(folder, ignore_errors=True)


def check_snoop(out: dict) -> None:
    assert out["data"] in ("FileNotFoundError", "PermissionError"), out
    assert out["socket"] in ("FileNotFoundError", "ConnectionRefusedError", "PermissionError"), out
    assert out["checkout"] is False and out["passwd"] is False, out
    assert not FORBIDDEN_TOP & set(out["root"]), out["root"]


# ------------------------------------------------------------------------------------------ trainer as root


@as_root
def test_escaped_processes_die_with_their_run(sandbox):
    limits = SandboxLimits(timeout_s=1.0, memory_mb=MEMORY_MB, max_procs=16)
    r = run_sandboxed_sync(ESCAPE, config=sandbox.with_limits(limits))
    assert r.timed_out
    assert r.details["pid_ns"] == r.stdout.strip()
    assert_namespace_gone(r.stdout.strip())


@as_root
def test_memory_limit_holds_for_the_whole_run(sandbox):
    r = run_sandboxed_sync(MEMORY_HOG, config=sandbox)
    assert r.ok, r.stderr
    assert int(r.stdout) <= MEMORY_MB
    assert sandbox.cgroup is not None  # root on this machine can make one: no fallback here
    assert r.details["memory_peak_bytes"] <= MEMORY_MB << 20


@as_root
def test_program_sees_a_minimal_root(sandbox, host_secrets):
    r = run_sandboxed_sync(SNOOP % host_secrets, config=sandbox)
    assert r.ok, r.stderr
    check_snoop(json.loads(r.stdout))


# --------------------------------------------------------------------------------------- trainer as nobody

_AS_NOBODY = (
    r"""
import json, logging, sys
sys.path.insert(0, sys.argv[1])  # argv[0] is '-c'
logging.basicConfig(level=logging.WARNING)
from lichen.rewards.sandbox import SandboxLimits, resolve_sandbox, run_sandboxed_sync
cfg = resolve_sandbox(limits=SandboxLimits(timeout_s=20.0, memory_mb=%d, max_procs=16))
out = {"mode": cfg.mode, "cgroup": cfg.cgroup is not None, "max_procs": cfg.limits.max_procs}
# forks allowed here (8 x 64 MiB): this run is about processes outliving it, not memory
many = SandboxLimits(timeout_s=1.0, memory_mb=512, max_procs=9, process_memory_mb=64)
escape = run_sandboxed_sync(sys.argv[2], config=cfg.with_limits(many))
out["escape"] = {"stdout": escape.stdout, "timed_out": escape.timed_out, "ns": escape.details.get("pid_ns")}
hog = run_sandboxed_sync(sys.argv[3], config=cfg)
out["hog"] = {"stdout": hog.stdout, "ok": hog.ok, "stderr": hog.stderr[-500:]}
snoop = run_sandboxed_sync(sys.argv[4], config=cfg)
out["snoop"] = {"stdout": snoop.stdout, "ok": snoop.ok, "stderr": snoop.stderr[-500:]}
print(json.dumps(out))
"""
    % MEMORY_MB
)


@as_nobody
@pytest.mark.slow
def test_unprivileged_trainer_holds_against_the_same_attacks(host_secrets):
    out, log = run_as_nobody(_AS_NOBODY, ESCAPE, MEMORY_HOG, SNOOP % host_secrets)
    assert out["mode"] == "userns"
    # item 5: escaped processes die with their run
    assert out["escape"]["timed_out"] and out["escape"]["ns"] == out["escape"]["stdout"].strip()
    assert_namespace_gone(out["escape"]["stdout"].strip())
    # item 6: nobody has no cgroup here, so the run's memory is split, and the log says so
    assert out["hog"]["ok"], out["hog"]
    assert int(out["hog"]["stdout"]) <= MEMORY_MB
    assert not out["cgroup"] and out["max_procs"] == 1
    assert "no cgroup with a memory controller" in log
    # item 7: a minimal root
    assert out["snoop"]["ok"], out["snoop"]
    check_snoop(json.loads(out["snoop"]["stdout"]))


def test_memory_split_without_a_cgroup():
    split = split_memory(SandboxLimits(memory_mb=1024, max_procs=32))
    assert split.max_procs * split.process_memory_mb <= 1024 and split.max_procs == 4
    assert split_memory(SandboxLimits(memory_mb=256, max_procs=16)).as_request()["max_procs"] == 1
    assert split_memory(SandboxLimits(memory_mb=100, max_procs=16)).as_request()["memory_bytes"] == 100 << 20
