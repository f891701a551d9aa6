"""A code program's reported values are decoded and judged in bounded work, off the event loop (issue 33,
item 6): a report whose set members all hash alike (quadratic to build: ~9 s of trainer CPU for 1 MiB), one
nested too deeply or holding too many values is refused (its check fails); the verdicts run on a worker thread
under the checks' timeout, so samples scored beside a hostile one are still judged correctly."""

from __future__ import annotations

import asyncio
import json
import os
import threading

import pytest

from lichen.rewards import code_reward
from lichen.rewards.code_checks import MAX_DEPTH, MAX_REPORT_NODES, MAX_SAME_HASH, OverBudget, decode, parse_report
from lichen.rewards.code_reward import CodeReward
from lichen.rewards.sandbox import SandboxLimits, resolve_sandbox

UID_BASE = 2_000_000_000 + ((os.getpid() + 750) % 1000) * 256
P = 2**61 - 1  # ints equal modulo P hash alike
COLLIDING = [k * P for k in range(40_000)]  # ~0.8 MB of report: fits the sandbox's 1 MiB output cap


def report(value) -> str:
    return json.dumps({"i": 0, "value": value}) + "\n"


def test_members_that_hash_alike_are_refused():
    assert parse_report(report({"set": COLLIDING}), 1) == {}  # refused, not decoded for seconds
    assert parse_report(report({"frozenset": COLLIDING[:100]}), 1) == {}
    assert parse_report(report({"dict": [[k, 0] for k in COLLIDING[:100]]}), 1) == {}
    with pytest.raises(OverBudget, match="hash alike"):
        decode({"tuple": [1, {"set": COLLIDING[: MAX_SAME_HASH + 1]}]})
    # a few members that hash alike are ordinary data (hash(-1) == hash(-2) in CPython)
    assert decode({"set": [-1, -2, *COLLIDING[: MAX_SAME_HASH - 2]]}) == {-1, -2, *COLLIDING[: MAX_SAME_HASH - 2]}
    assert parse_report(report({"set": list(range(50_000))}), 1) == {0: set(range(50_000))}


def test_depth_and_size_budgets():
    nested: object = 1
    for _ in range(MAX_DEPTH):
        nested = [nested]
    assert decode(nested) is not None
    with pytest.raises(OverBudget, match="nests deeper"):
        decode([nested])
    # the node budget holds for the whole report, across probes
    half = [0] * (MAX_REPORT_NODES // 2)
    lines = "".join(json.dumps({"i": i, "value": half}) + "\n" for i in range(3))
    assert sorted(parse_report(lines, 3)) == [0]  # the first fits; the second and third are over the budget


@pytest.fixture(scope="module")
def sandbox():
    return resolve_sandbox(uid_base=UID_BASE, limits=SandboxLimits(timeout_s=10.0, memory_mb=256, max_procs=16))


def fenced(program: str) -> str:
    return f"```python\n{program}\n```"


# forges the report (the program can write to the harness's report channel) with a set of colliding ints
ATTACK = f"""
import json, sys
line = json.dumps({{"i": 0, "value": {{"set": [k * {P} for k in range(40000)]}}}})
sys._getframe(1).f_locals["report"].write(line + "\\n")
def f():
    return {{3}}
"""
HONEST = "def f():\n    return {1, 2}"
LABEL = ["assert f() == {1, 2}"]


def test_verdicts_run_off_the_event_loop(sandbox, monkeypatch):
    """The check of the values waits until a coroutine on the loop lets it go: on the loop it would wait for
    itself (and give up after the bound below), on a worker thread the loop runs and releases it."""
    real, started, released, seen = code_reward.count_passed, threading.Event(), threading.Event(), []

    def gated(*a):
        started.set()
        seen.append(released.wait(20))  # a failure bound only: released at once when off the loop
        return real(*a)

    monkeypatch.setattr(code_reward, "count_passed", gated)
    grader = CodeReward(sandbox, case_timeout_s=120.0)

    async def go():
        task = asyncio.ensure_future(grader.grade(fenced(HONEST), LABEL, {}))
        while not task.done():
            if started.is_set():
                released.set()
            await asyncio.sleep(0.01)
        return task.result()

    assert asyncio.run(go()) == 1.0 and seen == [True]


def test_a_verdict_past_its_timeout_fails_its_cases(sandbox, monkeypatch):
    stop = threading.Event()
    # a check that would pass every case, but only after the bound (a failure bound: released at the end)
    monkeypatch.setattr(code_reward, "count_passed", lambda *a: (stop.wait(30), 1)[1])
    try:
        assert asyncio.run(CodeReward(sandbox, case_timeout_s=2.0).grade(fenced(HONEST), LABEL, {})) == 0.0
    finally:
        stop.set()


def test_the_collision_attack_scores_nothing_and_its_neighbours_are_judged(sandbox):
    """Through the reward runner, as `lichen train --rm-type code` scores: the attack and six honest samples
    at once; the honest ones are all correct and nothing is marked failed."""
    from helpers.rollout import reward_config

    from lichen.rewards import build_reward_fn, score_samples
    from lichen.types import Sample, Status

    args = reward_config(code_timeout=10.0, code_memory_mb=256, code_max_procs=16, code_sandbox_uid_base=UID_BASE)
    fn = build_reward_fn("code", None, args)
    samples = [Sample(response=fenced(ATTACK), label=LABEL, index=0)]
    samples += [Sample(response=fenced(HONEST), label=LABEL, index=i) for i in range(1, 7)]
    stats = score_samples(samples, fn, args, timeout=120.0)
    assert stats["num_failed"] == 0 and all(s.status != Status.FAILED for s in samples)
    assert [s.reward for s in samples] == [0.0] + [1.0] * 6
