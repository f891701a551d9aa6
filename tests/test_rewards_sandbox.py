"""The code sandbox holds against hostile programs (each case here succeeds when run without it), and the
`code` reward grades stdin/stdout, call-based and assert test cases through it."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
import uuid

import pytest
from helpers.rollout import reward_config
from helpers.sandbox_as_user import CAN_DROP, run_as_nobody

from lichen.rewards import build_reward_fn, score_samples
from lichen.rewards.code_reward import CodeReward, extract_code, outputs_match, parse_test_cases
from lichen.rewards.sandbox import (
    NOBODY,
    SandboxLimits,
    SandboxUnavailable,
    resolve_sandbox,
    run_sandboxed,
    run_sandboxed_sync,
)
from lichen.types import Sample, Status

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux namespaces")

TIMEOUT = 1.0
# a uid range of this test process's own, so parallel test workers never see each other's sandboxes
UID_BASE = 2_000_000_000 + (os.getpid() % 1000) * 256


@pytest.fixture(scope="module")
def sandbox():
    return resolve_sandbox(
        uid_base=UID_BASE, limits=SandboxLimits(timeout_s=TIMEOUT, memory_mb=256, max_procs=16, max_file_mb=1)
    )


def live_sandbox_processes(uid_base: int) -> list[str]:
    """Processes (not zombies) running as a sandbox uid right now."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        uid = int(status["Uid"].split()[0])
        in_range = uid == NOBODY if uid_base == NOBODY else uid_base <= uid < uid_base + 256
        if in_range and not status["State"].strip().startswith("Z"):
            out.append(f"{pid} {status['Name'].strip()}")
    return out


def assert_nothing_left(sandbox) -> None:
    deadline = time.monotonic() + 3.0
    while live_sandbox_processes(sandbox.uid_base) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_sandbox_processes(sandbox.uid_base) == []


def run(sandbox, source: str, **kw):
    return run_sandboxed_sync(source, config=sandbox, **kw)


# ------------------------------------------------------------------------------------------- isolation


def test_probe_runs_isolated(sandbox):
    r = run(sandbox, "import os; print(os.getuid(), os.getgid(), os.getgroups(), os.getpid(), os.getcwd())")
    assert r.ok, r.stderr
    uid, gid, groups, pid, cwd = r.stdout.split(maxsplit=4)
    if os.geteuid() == 0:
        assert int(uid) != 0 and int(gid) != 0 and groups == "[]"
    assert pid == "1"  # PID 1 of its own PID namespace
    assert cwd.strip() == "/tmp/sandbox"


def test_concurrent_runs_get_distinct_uids(sandbox):
    async def three():
        program = "import os, time\ntime.sleep(0.3)\nprint(os.getuid())"
        return await asyncio.gather(*(run_sandboxed(program, config=sandbox) for _ in range(3)))

    results = asyncio.run(three())
    uids = {int(r.stdout) for r in results}
    assert all(r.ok for r in results) and uids == {r.details["uid"] for r in results}
    if os.geteuid() == 0:
        assert len(uids) == 3 and all(UID_BASE <= u < UID_BASE + 256 for u in uids)


def test_bad_uid_base_is_refused():
    with pytest.raises(SandboxUnavailable, match="uid-base"):
        resolve_sandbox(uid_base=2**32 - 2)  # base + slot could reach 2**32 - 1, which setresuid reads as "keep"


def test_correct_program_reads_stdin(sandbox):
    r = run(sandbox, "import sys; print(sum(map(int, sys.stdin.read().split())))", stdin="1 2 39")
    assert r.ok and r.stdout == "42\n" and r.stderr == ""


def test_infinite_loop_is_killed_at_the_timeout(sandbox):
    t0 = time.perf_counter()
    r = run(sandbox, "while True:\n    pass\n")
    elapsed = time.perf_counter() - t0
    assert r.timed_out and not r.ok and r.returncode is None
    assert TIMEOUT <= elapsed < TIMEOUT + 1.5, elapsed
    assert_nothing_left(sandbox)


def test_sleeping_program_is_killed_at_the_timeout(sandbox):
    t0 = time.perf_counter()
    r = run(sandbox, "import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    assert r.timed_out and time.perf_counter() - t0 < TIMEOUT + 1.5
    assert r.stdout == "started\n"  # output before the kill is kept
    assert_nothing_left(sandbox)


def test_memory_bomb_is_stopped_by_the_limit(sandbox):
    r = run(sandbox, "x = bytearray(1 << 30)\nprint('allocated', len(x))\n")  # 1 GiB against a 256 MiB limit
    assert not r.ok and "allocated" not in r.stdout
    assert "MemoryError" in r.stderr


def test_fork_bomb_is_stopped_by_the_process_limit(sandbox):
    # capped at 300 forks so that a broken sandbox cannot take the machine down
    program = """
import os, time
made = 0
for _ in range(300):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    made += 1
print(made)
"""
    r = run(sandbox, program)
    assert r.ok, r.stderr
    made = int(r.stdout)
    assert made < 16  # RLIMIT_NPROC 16 counts the program itself
    assert_nothing_left(sandbox)  # the sleeping children died with PID 1 of the namespace


def test_escaped_session_dies_with_the_sandbox(sandbox):
    program = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')\n"
    r = run(sandbox, program)
    assert r.ok and r.stdout == "parent done\n"
    assert_nothing_left(sandbox)


def test_writes_outside_the_temp_dir_leave_the_path_untouched(sandbox, tmp_path):
    inside = tmp_path / "target.txt"
    inside.write_text("original")
    os.chmod(tmp_path, 0o777)
    os.chmod(inside, 0o666)  # writable by anyone: only the mount namespace protects it
    fresh_tmp = f"/tmp/lichen-sandbox-test-{uuid.uuid4().hex}"
    fresh_shm = f"/dev/shm/lichen-sandbox-test-{uuid.uuid4().hex}"
    program = f"""
results = []
for path in ({str(inside)!r}, {fresh_tmp!r}, {fresh_shm!r}, "/work/lichen-sandbox-test.txt", "/etc/lichen-test"):
    try:
        with open(path, "w") as f:
            f.write("written by the sandbox")
        results.append("wrote")
    except OSError as e:
        results.append(type(e).__name__)
with open("inside.txt", "w") as f:  # its own work directory is writable
    f.write("ok")
print(" ".join(results))
"""
    try:
        r = run(sandbox, program)
        assert r.ok, r.stderr
        assert inside.read_text() == "original"
        for path in (fresh_tmp, fresh_shm, "/work/lichen-sandbox-test.txt", "/etc/lichen-test"):
            assert not os.path.exists(path), path
    finally:
        for path in (fresh_tmp, fresh_shm):
            if os.path.exists(path):
                os.remove(path)


def test_file_size_limit(sandbox):
    r = run(sandbox, "with open('big', 'wb') as f:\n    f.write(b'x' * (4 << 20))\nprint('wrote')\n")
    assert not r.ok and "wrote" not in r.stdout  # RLIMIT_FSIZE 1 MiB


def test_loopback_listener_cannot_be_reached(sandbox):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.3)
    port = listener.getsockname()[1]
    program = f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=1).sendall(b"hello")
    print("connected")
except OSError as e:
    print("refused", type(e).__name__)
"""
    try:
        r = run(sandbox, program)
        assert r.ok and r.stdout.startswith("refused"), r.stdout + r.stderr
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()


def test_output_flood_is_cut(sandbox):
    r = run(sandbox, "while True:\n    print('x' * 1000)\n")
    assert r.output_limited and not r.ok and len(r.stdout) <= SandboxLimits().max_output_bytes
    assert_nothing_left(sandbox)


# ------------------------------------------------------------------------------------------- code reward

ADD_STDIO = {"inputs": ["1 2", "3 4", "10 20", "7 7"], "outputs": ["3", "7", "30\n", "14"]}


def fenced(code: str, lang: str = "python") -> str:
    return f"Here is my solution.\n```{lang}\n{code}\n```\nDone."


def test_extract_code_and_cases():
    assert extract_code(fenced("print(1)")) == "print(1)\n"
    assert extract_code("```py\na\n```\n```python\nb\n```") == "b\n"
    assert extract_code("<think>```python\nx\n```</think> no code after thinking") is None
    assert extract_code("print(1)") is None
    assert parse_test_cases('[{"input": "1", "output": "2"}]', {}) == ("stdio", [("1", "2")])
    kind, cases = parse_test_cases(None, {"test_cases": ["assert f() == 1"]})
    assert kind == "checks" and [c.probe for c in cases[0].checks] == [{"expr": "f()"}]
    kind, cases = parse_test_cases({"fn_name": "f", "inputs": [[1, 2]], "outputs": [3]}, {})
    assert kind == "checks" and [c.probe for c in cases[0].checks] == [{"call": "f", "args": [1, 2]}]
    for bad in (
        None,
        "not json",
        {"inputs": ["1"], "outputs": []},
        [{"input": "1"}],
        {"fn_name": "a b", "inputs": [1], "outputs": [1]},
    ):
        with pytest.raises(ValueError, match="code:"):
            parse_test_cases(bad, {})


def test_outputs_match():
    assert outputs_match("1 2\n3\n", "1 2 3")
    assert outputs_match("0.3333333333", "0.333333333")
    assert not outputs_match("1 2", "1 2 3")
    assert not outputs_match("0.33", "0.333333")
    assert not outputs_match("abc", "abd")


@pytest.mark.slow
def test_code_reward_pass_fractions(sandbox):
    grader = CodeReward(sandbox, case_timeout_s=TIMEOUT)
    solve = "import sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b)"
    half = "import sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b if a < 5 else -1)"
    g = lambda response, label: asyncio.run(grader.grade(response, label, {}))  # noqa: E731
    assert g(fenced(solve), ADD_STDIO) == 1.0
    assert g(fenced(half), ADD_STDIO) == 0.5
    assert g(fenced("raise SystemExit(3)"), ADD_STDIO) == 0.0  # non-zero exit fails every case
    assert g("no code block", ADD_STDIO) == 0.0
    fn = "def add(a, b):\n    return a + b if a < 5 else None\nprint('top-level noise')"
    calls = {"fn_name": "add", "inputs": [[1, 2], [3, 4], [10, 20]], "outputs": [3, [7], 30]}
    assert g(fenced(fn, "py"), calls) == pytest.approx(2 / 3)  # [7] also matches 7, as in APPS
    fn += "\ndef spin():\n    while True:\n        pass\n"
    asserts = ["assert add(1, 2) == 3", "assert add(9, 1) == 10", "assert spin() == 0", "assert add(2, 2) == 4"]
    # case 2 hangs: cases 0 (pass) and 1 (fail) were reported before the kill, 2 and 3 count as failed
    quick = CodeReward(sandbox, case_timeout_s=0.4)
    assert asyncio.run(quick.grade(fenced(fn), asserts, {})) == 0.25


def test_code_reward_results_cannot_be_forged(sandbox):
    grader = CodeReward(sandbox, case_timeout_s=TIMEOUT)
    forged = "import os\nfor i in range(3):\n    print('deadbeef', i, 1)\nos._exit(0)"
    assert asyncio.run(grader.grade(fenced(forged), ["assert False"] * 3, {})) == 0.0


@pytest.mark.slow
def test_code_rm_type_through_the_runner(sandbox):
    args = reward_config(code_timeout=30.0, code_memory_mb=256, code_max_procs=16, code_sandbox_uid_base=UID_BASE)
    fn = build_reward_fn("code", None, args)
    solve = fenced("print(int(input()) * 2)")
    samples = [
        Sample(response=solve, label={"inputs": ["2", "5"], "outputs": ["4", "10"]}, index=0),
        Sample(response=solve, label={"inputs": ["2", "5"], "outputs": ["4", "11"]}, index=1),
        Sample(response=solve, label="garbage", index=2),  # malformed test cases: the sample fails
        Sample(response=fenced("while True: pass"), label={"inputs": ["1"], "outputs": ["2"]}, index=3),
        # a math run can still carry code samples, and the other way round
        Sample(response=r"\boxed{4}", label="4", index=4, metadata={"rm_type": "math"}),
    ]
    # the runner's timeout is shorter than the case's; both generous (CI at load 3 saw a 2-case run exceed 0.5 s)
    stats = score_samples(samples, fn, args, timeout=10.0)
    assert [s.reward for s in samples[:2]] == [1.0, 0.5] and samples[4].reward == 1.0
    failed = dict(stats["failed"])
    assert set(failed) == {2, 3}
    assert failed[2].startswith("ValueError: code:") and failed[3] == "timeout after 10.0 s"
    assert samples[3].status == Status.FAILED
    assert_nothing_left(fn._code.sandbox)  # the cancelled run's process group was killed


# ------------------------------------------------------------------------------- a non-root trainer (userns)

_NON_ROOT_SCRIPT = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])  # argv[0] is '-c'
from lichen.rewards.sandbox import SandboxLimits, resolve_sandbox, run_sandboxed_sync
cfg = resolve_sandbox(limits=SandboxLimits(timeout_s=2.0, memory_mb=256, max_procs=16))
prog = '''
import os, socket, ctypes
out = [os.getuid(), os.getpid()]
try:
    socket.create_connection(("127.0.0.1", 9), timeout=1)
    out.append("net open")
except OSError:
    out.append("net closed")
try:
    open(%r, "w").write("pwned")
    out.append("wrote")
except OSError as e:
    out.append(type(e).__name__)
out.append(ctypes.CDLL(None).umount2(b"/tmp", 2))
print(out)
''' % sys.argv[2]
r = run_sandboxed_sync(prog, config=cfg)
print(json.dumps({"mode": cfg.mode, "stdout": r.stdout, "ok": r.ok, "stderr": r.stderr}))
"""


@pytest.mark.skipif(not CAN_DROP, reason="needs root, setpriv and /usr/bin/python3")
def test_non_root_trainer_gets_a_user_namespace_sandbox():
    import shutil
    import tempfile

    # the non-root trainer's own directory, outside any tmpfs the sandbox covers: only the minimal root keeps it
    # out of reach (the test runs as root, so one of these is writable unless the root file system is read-only)
    base = next((d for d in ("/run", "/var/lib", "/opt", "/root") if os.path.isdir(d) and os.access(d, os.W_OK)), None)
    assert base is not None, "root found no writable directory outside /tmp (read-only root file system?)"
    owned = tempfile.mkdtemp(prefix="lichen-sandbox-test-", dir=base)
    try:
        os.chmod(owned, 0o755)
        os.chown(owned, NOBODY, NOBODY)
        target = os.path.join(owned, "f")
        result, _ = run_as_nobody(_NON_ROOT_SCRIPT, target)
        assert not os.path.exists(target)
    finally:
        shutil.rmtree(owned, ignore_errors=True)
    assert result["mode"] == "userns" and result["ok"], result
    uid, pid, net, write, umount = eval(result["stdout"])  # the program printed a Python list
    assert (uid, pid, net, umount) == (1000, 1, "net closed", -1)  # not root inside; /tmp cannot be unmounted
    assert write in ("OSError", "FileNotFoundError")  # the host's directories are not in its root at all


def test_code_samples_in_a_math_run_build_the_sandbox_on_first_use():
    args = reward_config(code_timeout=TIMEOUT, code_sandbox_uid_base=UID_BASE)
    fn = build_reward_fn("math", None, args)
    assert fn._code is None
    samples = [
        Sample(response=r"\boxed{2}", label="2", index=0),
        Sample(
            response=fenced("print(7)"), label={"inputs": [""], "outputs": ["7"]}, index=1, metadata={"rm_type": "code"}
        ),
    ]
    stats = score_samples(samples, fn, args)
    assert stats["num_failed"] == 0 and [s.reward for s in samples] == [1.0, 1.0]
    assert fn._code is not None
