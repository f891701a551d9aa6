"""lichen.cluster.leftovers: a trainer rank process that outlives ray.kill on the driver's host is SIGKILLed after
the grace period, identified by pid and start time, so a process that merely got the same pid is never hit. Real
processes (`sleep`), no Ray: the group's tear-down calls this with its ranks' `where` entries."""

from __future__ import annotations

import os
import subprocess
import time

from lichen.cluster import leftovers


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"])


def test_start_time_identifies_a_process_and_none_once_it_is_gone():
    p = _sleeper()
    try:
        started = leftovers.start_time(p.pid)
        assert isinstance(started, int) and started > 0
        assert leftovers.start_time(p.pid) == started
        assert leftovers.start_time(os.getpid()) is not None
    finally:
        p.kill()
        p.wait()
    assert leftovers.start_time(p.pid) is None  # reaped: no such process


def test_a_survivor_is_killed_and_a_pid_with_another_start_time_is_not():
    alive, other = _sleeper(), _sleeper()
    try:
        procs = [(alive.pid, leftovers.start_time(alive.pid)), (other.pid, -1)]  # -1: not the process we recorded
        assert leftovers.survivors(procs) == [alive.pid]
        assert leftovers.kill_survivors(procs) == [alive.pid]
        assert alive.wait(10) == -9
        assert other.poll() is None  # same pid, another start time: left alone
    finally:
        other.kill()
        other.wait()


def test_the_sweep_waits_for_the_grace_period_and_kills_only_what_is_left():
    gone, stuck = _sleeper(), _sleeper()
    procs = [(p.pid, leftovers.start_time(p.pid)) for p in (gone, stuck)]
    t0 = time.monotonic()
    thread = leftovers.sweep_later(procs, grace=1.0)
    gone.kill()  # ends by itself within the grace period (as ray.kill usually does)
    gone.wait()
    thread.join(30)
    assert not thread.is_alive() and time.monotonic() - t0 >= 1.0
    assert stuck.wait(10) == -9


def test_the_sweep_ends_early_when_every_process_is_gone():
    p = _sleeper()
    procs = [(p.pid, leftovers.start_time(p.pid))]
    thread = leftovers.sweep_later(procs, grace=60.0)
    p.kill()
    p.wait()
    thread.join(10)
    assert not thread.is_alive()
