"""The reused daemon threads behind synchronous verifiers (lichen.rewards.runner._DaemonPool).

Conditions with generous deadlines, never timing windows: the machine running these may be heavily loaded.
"""

from __future__ import annotations

import os
import threading
import time

from lichen.rewards import runner
from lichen.rewards.runner import score_samples
from lichen.types import Sample, Status

DEADLINE_S = 60.0


def samples(n: int) -> list[Sample]:
    return [Sample(index=i, group_index=i, response=str(i)) for i in range(n)]


def wait_until(condition, what: str) -> None:
    end = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < end, f"gave up waiting for {what}"
        time.sleep(0.01)


def test_sequential_calls_reuse_one_idle_thread():
    """Thread per call was most of a cheap batch's scoring time: an idle pooled thread takes the next call."""
    seen: list[threading.Thread] = []  # the Thread objects themselves: an ident may be reused by a new thread

    def fn(args, sample):
        seen.append(threading.current_thread())
        return 1.0

    idle_before = runner._POOL.idle_threads()
    for i in range(12):
        # the previous call's thread counts itself idle just after handing over its result: wait for it
        if i:
            wait_until(lambda: runner._POOL.idle_threads() >= max(idle_before, 1), "an idle verifier thread")
        stats = score_samples(samples(1), fn, None, concurrency=1, timeout=DEADLINE_S)
        assert stats["num_failed"] == 0
    distinct = {id(t) for t in seen}
    # every call found an idle thread: at most one new thread, plus threads left idle by earlier tests
    assert len(distinct) <= idle_before + 1, (len(distinct), idle_before)
    assert all(t.daemon for t in seen)


def test_hung_verifiers_time_out_and_later_calls_still_run():
    """A hung call is abandoned after its timeout; its thread is not idle, so later calls get other threads."""
    release = threading.Event()
    hung = {0, 1, 2}

    def fn(args, sample):
        if sample.index in hung:
            release.wait(DEADLINE_S * 2)  # hung until the test lets it go
        return float(sample.index)

    try:
        batch = samples(3)
        stats = score_samples(batch, fn, None, concurrency=3, timeout=0.5)
        assert stats["num_failed"] == 3
        assert all(s.status == Status.FAILED for s in batch)
        assert all(s.metadata["reward_error"] == "timeout after 0.5 s" for s in batch)
        # the three threads are still stuck: the next batch must not wait for them
        hung.clear()
        later = samples(8)
        stats = score_samples(later, fn, None, concurrency=4, timeout=DEADLINE_S)
        assert stats["num_failed"] == 0
        assert [s.reward for s in later] == [float(i) for i in range(8)]
    finally:
        release.set()


def test_forked_child_scores_with_its_own_threads():
    """A forked child has none of the parent's (idle) threads; its pool must start its own."""
    score_samples(samples(4), lambda args, s: 1.0, None, timeout=DEADLINE_S)
    wait_until(lambda: runner._POOL.idle_threads() >= 1, "an idle verifier thread in the parent")
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if its call ran (a call queued for a thread that is not there times out)
        code = 1
        try:
            batch = samples(1)
            stats = score_samples(batch, lambda args, s: 2.0, None, timeout=10.0)
            code = 0 if stats["num_failed"] == 0 and batch[0].reward == 2.0 else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_thread_that_cannot_start_fails_only_its_call(monkeypatch):
    """If no thread can be started, that call fails with the error, and it is not run later by another thread."""
    monkeypatch.setattr(runner, "_POOL", runner._DaemonPool())  # no idle threads: the call needs a new one
    calls: list[int] = []

    def fn(args, sample):
        calls.append(sample.index)
        return 1.0

    def refuse(self):
        raise RuntimeError("can't start new thread")

    with monkeypatch.context() as m:
        m.setattr(runner.threading.Thread, "start", refuse)
        first = samples(1)
        stats = score_samples(first, fn, None, timeout=DEADLINE_S)
    assert stats["num_failed"] == 1
    assert first[0].metadata["reward_error"] == "RuntimeError: can't start new thread"
    later = [Sample(index=7, group_index=7, response="7")]
    stats = score_samples(later, fn, None, timeout=DEADLINE_S)
    assert stats["num_failed"] == 0
    assert calls == [7]  # the refused call never ran
