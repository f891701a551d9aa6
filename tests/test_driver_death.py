"""`kill -9` of `lichen train` leaves nothing behind (docs/fault-tolerance.md#driver-death), and `--load` of the
same command resumes.

A real `lichen train` runs as a child process with its own run marker (LICHEN_RUN_ID); the test lists the run's
processes by that marker in /proc (lichen.lifetime.run_processes), never by name:
- local runtime, two launched `lichen serve` engines under --use-fault-tolerance; one engine is SIGKILLed first,
  so the monitor restarts it from a worker thread (the case the parent-death signal used to miss), then the
  driver is SIGKILLed after its first checkpoint: within 30 s no process of the run is alive;
- --runtime ray with the Ray instance the driver started: the same, Ray's processes included (its agents
  outlive the driver without lichen.cluster.ray_reaper).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from helpers.runs import base_args

from lichen.lifetime import run_processes
from lichen.observe.metrics import read_metrics

pytestmark = pytest.mark.e2e  # see the marker in pyproject.toml: make test leaves it to make test-e2e

GONE_WITHIN_S = 30.0
HOLD_ENV = "LICHEN_TEST_HOLD_AFTER_CHECKPOINT"  # a directory: the reward holds the run once it has a checkpoint


def held_reward(args, sample) -> float:
    """--custom-rm-path for the killed runs: the digit fraction, but once the run has saved a checkpoint (the
    directory in $LICHEN_TEST_HOLD_AFTER_CHECKPOINT) the next step's scoring never returns, so the driver is
    mid-run, with a checkpoint behind it, when the test kills it (no race with a run that finishes first)."""
    hold = os.environ.get(HOLD_ENV)
    if hold and checkpoint_exists(hold):
        with open(os.path.join(hold, "..", "held"), "w"):
            pass
        while True:
            time.sleep(3600)
    text = sample.response
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def wait_for(cond, timeout: float, what: str):
    end = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > end:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.2)


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def serve_pids(run_id: str) -> list[int]:
    """The run's `lichen serve` engines (the -c wrapper execs into the server, so its cmdline names `serve`)."""
    return [p for p in run_processes(run_id) if " serve --model " in cmdline(p)]


def start_train(argv: list[str], run_id: str, log, hold: str | None = None) -> subprocess.Popen:
    env = {**os.environ, "LICHEN_RUN_ID": run_id, "PYTHONPATH": os.path.dirname(__file__)}
    if hold:
        env[HOLD_ENV] = hold
    return subprocess.Popen([sys.executable, "-m", "lichen.cli", *argv], stdout=log, stderr=subprocess.STDOUT, env=env)


def assert_all_gone(run_id: str, driver: subprocess.Popen) -> float:
    """SIGKILL the driver; every process of the run must be gone within 30 s. Returns how long it took."""
    t0 = time.monotonic()
    driver.send_signal(signal.SIGKILL)
    driver.wait(30)
    end = t0 + GONE_WITHIN_S
    while True:
        left = run_processes(run_id)
        if not left:
            return time.monotonic() - t0
        if time.monotonic() > end:
            described = "; ".join(f"{p}: {cmdline(p)[:120]}" for p in left)
            for p in left:  # do not leave them to the next test
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            pytest.fail(f"{len(left)} process(es) of the run alive {GONE_WITHIN_S:g} s after kill -9: {described}")
        time.sleep(0.2)


def checkpoint_exists(save: str) -> bool:
    return os.path.exists(os.path.join(save, "latest_checkpointed_iteration.txt"))


def resume_and_finish(argv: list[str], run_id: str, tmp_path) -> str:
    """Run the same command with --load (not held): it resumes from the checkpoint and finishes."""
    with open(tmp_path / "resume.log", "wb") as log:
        proc = start_train(argv, run_id + "-2", log)
        assert proc.wait(600) == 0, (tmp_path / "resume.log").read_text()[-3000:]
    text = (tmp_path / "resume.log").read_text()
    assert "resumed from" in text, text[-3000:]
    assert not run_processes(run_id + "-2")  # a run that ends leaves nothing either
    return text


def killed_run_args(tiny_ckpt, addition_data, tmp_path, *extra: str) -> tuple[list[str], str]:
    save = str(tmp_path / "ckpt")
    os.makedirs(save)  # --load of an empty directory starts fresh, so one command line starts and resumes
    argv = base_args(tiny_ckpt, addition_data, tmp_path / "out", "--num-rollout", "3", "--num-threads", "1", *extra)
    argv[argv.index("--custom-rm-path") + 1] = "test_driver_death.held_reward"
    return argv + ["--save", save, "--save-interval", "1", "--load", save], save


def kill_held_run(argv: list[str], save: str, tmp_path, before_kill) -> None:
    """Start `lichen train argv` (held once it has a checkpoint), run `before_kill(run_id, log_text)` while it
    runs, wait until it holds, SIGKILL it: nothing of it may be alive 30 s later. Then the same command resumes."""
    run_id = "test-" + uuid.uuid4().hex
    log_text = (tmp_path / "train.log").read_text
    with open(tmp_path / "train.log", "wb") as log:
        driver = start_train(argv, run_id, log, hold=save)
        try:
            before_kill(run_id, log_text)
            wait_for(lambda: (tmp_path / "held").exists(), 900, "the run to hold after its first checkpoint")
            # whole command lines: cut to a width, a long interpreter path (a clone under a long directory)
            # hides the subcommand
            names = [cmdline(p) for p in run_processes(run_id)]
            assert any(" serve " in n for n in names), names  # the run's engines carry its marker
            took = assert_all_gone(run_id, driver)
        finally:
            if driver.poll() is None:
                driver.kill()
    print(f"every process of the run gone {took:.1f} s after kill -9")
    resume_and_finish(argv, run_id, tmp_path)


@pytest.mark.slow
def test_kill_9_of_a_local_run_leaves_nothing(tiny_ckpt, addition_data, tmp_path):
    fault_tolerance = ["--use-fault-tolerance", "--rollout-health-check-interval", "0.5"]
    fault_tolerance += ["--rollout-health-check-timeout", "30", "--rollout-health-check-first-wait", "0"]
    disk = ["--update-weight-transport", "disk", "--update-weight-disk-dir", str(tmp_path / "w")]
    argv, save = killed_run_args(
        tiny_ckpt, addition_data, tmp_path, "--rollout-num-engines", "2", *disk, *fault_tolerance
    )

    def restart_an_engine(run_id: str, log_text) -> None:
        # both engines answered lichen's start-up checks (the health monitor starts right after)
        wait_for(lambda: log_text().count(", weight version ") >= 2, 600, "two engines to be ready")
        first = serve_pids(run_id)
        assert len(first) == 2, [cmdline(p) for p in run_processes(run_id)]
        os.kill(first[0], signal.SIGKILL)  # the monitor restarts it, from a worker thread
        wait_for(lambda: "engine 0 restarted" in log_text(), 600, "the engine to be restarted")
        restarted = serve_pids(run_id)
        assert len(restarted) == 2 and first[0] not in restarted, [cmdline(p) for p in run_processes(run_id)]

    kill_held_run(argv, save, tmp_path, restart_an_engine)
    # the pool's metrics of both runs' steps (the killed run's first, the resumed run's)
    pool = [{k: m[k] for k in m if k.startswith("engines/")} for m in read_metrics(str(tmp_path / "out"))]
    pool = [p for p in pool if p]
    steady = {"engines/healthy": 2.0, "engines/retired": 0.0, "engines/added": 0.0}
    assert pool and all({k: v for k, v in p.items() if k != "engines/restarts"} == steady for p in pool), pool
    # engines/restarts counts per run: the one restart of the killed run (if a row came after it), 0 once resumed
    assert all(p["engines/restarts"] in (0.0, 1.0) for p in pool), pool


@pytest.mark.slow
def test_kill_9_of_a_ray_run_stops_the_ray_it_started(tiny_ckpt, addition_data, tmp_path):
    ray = ["--runtime", "ray", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1"]
    argv, save = killed_run_args(tiny_ckpt, addition_data, tmp_path, *ray)

    def ray_is_up(run_id: str, log_text) -> None:
        wait_for(lambda: "raylet" in " ".join(map(cmdline, run_processes(run_id))), 600, "the run's Ray instance")

    kill_held_run(argv, save, tmp_path, ray_is_up)


SANDBOX_HOST = r"""
import sys
from lichen.rewards.sandbox import SandboxLimits, resolve_sandbox, run_sandboxed_sync
cfg = resolve_sandbox().with_limits(SandboxLimits(timeout_s=600, cpu_s=600))
print("RUNNING", flush=True)
run_sandboxed_sync("import time\nprint('in', flush=True)\ntime.sleep(600)\n", config=cfg)
"""


def children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(c) for c in f.read().split()]
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux namespaces")
def test_kill_9_of_the_trainer_ends_its_sandboxes(tmp_path):
    """A process running a sandboxed program (sleeping, far inside its time limits) is SIGKILLed: the sandbox
    launcher and the program are gone within 30 s."""
    run_id = "test-" + uuid.uuid4().hex
    env = {**os.environ, "LICHEN_RUN_ID": run_id}
    host = subprocess.Popen([sys.executable, "-c", SANDBOX_HOST], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert host.stdout is not None and host.stdout.readline().strip() == "RUNNING"
        launchers = wait_for(lambda: [p for p in run_processes(run_id) if p != host.pid], 120, "the sandbox launcher")
        # the program: the namespace's PID 1 (the launcher's child) and whatever it started, by host pid
        program = wait_for(lambda: [c for p in launchers for c in children(p)], 120, "the sandboxed program")
        watched = launchers + program
        host.send_signal(signal.SIGKILL)
        host.wait(30)
        wait_for(
            lambda: not [p for p in watched if os.path.exists(f"/proc/{p}") and not zombie(p)],
            GONE_WITHIN_S,
            "the sandbox launcher and program to die with their trainer",
        )
    finally:
        if host.poll() is None:
            host.kill()


def zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] == b"Z"
    except OSError:
        return True


REAPED_DRIVER = r"""
import os, subprocess, sys, time
from lichen.cluster.ray_reaper import start_reaper, stop_reaper
from lichen.lifetime import mark_run
mark_run()
pipe = start_reaper()
# a process of the run that nothing else stops (as Ray's agents, which can outlive their driver)
child = subprocess.Popen(["sleep", "600"])
print(child.pid, flush=True)
if sys.argv[1] == "killed":
    # as Ray's agents at times: a ray:: process of the run (LICHEN_RUN_ID) without the instance marker, orphaned
    env = {k: v for k, v in os.environ.items() if k != "LICHEN_RUN_INSTANCE"}
    subprocess.run(["bash", "-c", "(exec -a ray::FakeAgent sleep 600 &)"], env=env, check=True)
if sys.argv[1] == "forked":
    # a forked child inherits every descriptor, the driver's end of the reaper's pipe too: the pipe stays open
    # when the driver dies, the reaper must notice the death itself. (The forked child itself is out of its reach:
    # /proc shows a process's environment as exec'd, and this one's was exec'd before mark_run.)
    if os.fork() == 0:
        time.sleep(600)
        os._exit(0)
if sys.argv[1] == "done":
    stop_reaper(pipe)  # the driver stopped its Ray itself: the reaper leaves
    print("stopped", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("ending", ["killed", "forked", "done"])
def test_ray_reaper_stops_what_the_killed_driver_started(tmp_path, ending):
    """The reaper of lichen.cluster.ray_reaper, deterministically: a driver that dies (SIGKILL) leaves nothing
    carrying its instance marker; one that said `done` (it stopped its Ray) has its processes left alone."""
    run_id = "test-" + uuid.uuid4().hex
    env = {**os.environ, "LICHEN_RUN_ID": run_id}
    driver = subprocess.Popen([sys.executable, "-c", REAPED_DRIVER, ending], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert driver.stdout is not None
        child = int(driver.stdout.readline())
        if ending == "done":
            assert driver.stdout.readline().strip() == "stopped"
        wait_for(lambda: {driver.pid, child} <= set(run_processes(run_id)), 60, "the driver and its child")
        driver.send_signal(signal.SIGKILL)
        driver.wait(30)
        if ending == "killed":
            wait_for(lambda: not run_processes(run_id), GONE_WITHIN_S, "the reaper to stop the driver's processes")
        elif ending == "forked":
            wait_for(lambda: child not in run_processes(run_id), GONE_WITHIN_S, "the reaper to stop the child")
        else:
            # the reaper has exited (it carries the marker too) and the child is alive: it left, touching nothing
            wait_for(lambda: run_processes(run_id) == [child], GONE_WITHIN_S, "the reaper to leave")
    finally:
        for pid in run_processes(run_id):
            os.kill(pid, signal.SIGKILL)
