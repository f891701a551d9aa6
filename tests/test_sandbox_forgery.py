"""Assert and call-based verdicts are computed by the trainer: a program that forges its report, patches the
harness, or returns objects that claim to equal anything scores nothing."""

from __future__ import annotations

import asyncio
import os

import pytest

from lichen.rewards.code_checks import decode, lenient_equal, split_assert
from lichen.rewards.code_reward import CodeReward
from lichen.rewards.sandbox import SandboxLimits, resolve_sandbox

UID_BASE = 2_000_000_000 + ((os.getpid() + 500) % 1000) * 256


@pytest.fixture(scope="module")
def grader():
    sandbox = resolve_sandbox(uid_base=UID_BASE, limits=SandboxLimits(timeout_s=5.0, memory_mb=256, max_procs=16))
    return CodeReward(sandbox, case_timeout_s=5.0)


def grade(grader, program: str, label) -> float:
    return asyncio.run(grader.grade(f"```python\n{program}\n```", label, {}))


ASSERTS = ["assert add(1, 2) == 3", "assert add(5, 5) == 10", "assert 7 == add(3, 4)"]
CALLS = {"fn_name": "add", "inputs": [[1, 2], [5, 5]], "outputs": [3, 10]}

ALWAYS_EQUAL = """
class Anything(int):
    def __eq__(self, other):
        return True
    __hash__ = int.__hash__
def add(a, b):
    return Anything(0)
"""

# the known exploit of the old harness: find the harness's frame, take its report channel and nonce, and print a pass
# marker for every case (old format), plus a forged value for every probe (new format)
FRAME_FORGERY = """
import json, sys
frame = sys._getframe(0)
while frame is not None and "report" not in frame.f_locals:
    frame = frame.f_back
loc = frame.f_locals
report = loc["report"]
for i in range(10):
    if "mark" in loc:
        print(loc["mark"], i, 1, file=report, flush=True)
    report.write(json.dumps({"i": i, "value": 0}) + "\\n")
report.flush()
def add(a, b):
    return -1
"""

PATCHING = """
import builtins, json
builtins.__lichen_eq__ = lambda *a: True
json.dumps = lambda *a, **k: '{"i": 0, "value": true}'
def add(a, b):
    return None
print("ok ok ok")
raise SystemExit(0)
"""


@pytest.mark.parametrize("program", [ALWAYS_EQUAL, FRAME_FORGERY, PATCHING], ids=["eq", "frame", "patch"])
def test_forged_results_score_nothing(grader, program):
    assert grade(grader, program, ASSERTS) == 0.0
    assert grade(grader, program, CALLS) == 0.0


def test_correct_program_passes_every_form(grader):
    program = "import math\ndef add(a, b):\n    return a + b\ndef pair(x):\n    return (x, {x}, {'k': [x]}, b'x')\ndef positive(x):\n    return x > 0"
    asserts = ASSERTS + [
        "assert add(1, 1) != 3",
        "assert add(2, 2) in [4, 5]",
        "assert not add(0, 0)",
        "assert add(1, 0)",
        "assert math.isclose(add(0.1, 0.2), 0.3, rel_tol=1e-9)",
        "assert abs(add(1.5, 1) - 2.5) < 1e-9",
        "assert pair(3) == (3, {3}, {'k': [3]}, b'x')",
        "assert set([add(1, 1)]) == set((2,))",
        "assert add(10**9, 7) == 10**9 + 7",
        "assert add([0], [0] * 2) == [0] * 3",
        "assert add(1, 2) == 3 and add(2, 3) == 5",
        "assert positive(1) is True",
        "assert positive(-1) is not True",
    ]
    assert grade(grader, program, asserts) == 1.0
    wrong = "def add(a, b):\n    return a - b\ndef pair(x):\n    return [x]"
    assert grade(grader, wrong, asserts) < 0.5
    assert grade(grader, program, CALLS) == 1.0


def test_expected_values_never_enter_the_sandbox(grader, monkeypatch):
    import lichen.rewards.code_reward as code_reward

    # the program prints everything it can reach: the harness's frames and the files beside it (stdin included,
    # since the harness read it into its locals)
    spy = """
import os, sys
seen = [repr(sys._getframe(i).f_locals) for i in range(1, 3)]
seen += [open(n).read() for n in os.listdir(".")]
sys.stderr.write("\\n".join(seen))
raise SystemExit(1)
"""
    seen = []
    real_run = code_reward.run_sandboxed

    async def recording_run(*a, **kw):
        result = await real_run(*a, **kw)
        seen.append(result.stderr)
        return result

    monkeypatch.setattr(code_reward, "run_sandboxed", recording_run)
    label = ["assert add(1, 2) == 'SECRET-A'", "assert 'SECRET-B' == add(1, 3)"]
    assert grade(grader, spy, label) == 0.0
    assert len(seen) == 1 and "add(1, 2)" in seen[0] and "SECRET" not in seen[0]


def test_unsplittable_asserts_fail_closed(grader, caplog):
    program = "def add(a, b):\n    return a + b"
    cases = [
        "assert all(add(i, i) == 2 * i for i in range(3))",
        "import os",
        "assert add(1, 1) == add(2, 0)",
        "assert 1 < add(1, 1) < 3",
        "assert add(1, 1) is 2",
    ]
    for case in cases:
        assert split_assert(case).checks == []
    assert grade(grader, program, cases) == 0.0
    assert "cannot be checked outside the sandbox" in caplog.text


def test_values_decode_to_plain_builtins():
    assert decode({"tuple": [1, {"set": [2]}, {"dict": [["a", {"frozenset": []}]]}, {"bytes": "6869"}]}) == (
        1,
        {2},
        {"a": frozenset()},
        b"hi",
    )
    for bad in ({"object": []}, {"a": 1, "b": 2}, {"tuple": 3}):
        with pytest.raises(ValueError):
            decode(bad)
    assert lenient_equal((1, 2.0000000001), [1, 2]) and lenient_equal(7, [7]) and not lenient_equal(7, [8])


def test_forgeries_score_nothing_through_the_reward_runner():
    # the path `lichen train --rm-type code` takes: the reward hub builds the sandbox, the runner scores samples
    from helpers.rollout import reward_config

    from lichen.rewards import build_reward_fn, score_samples
    from lichen.types import Sample

    args = reward_config(code_timeout=5.0, code_memory_mb=256, code_max_procs=16, code_sandbox_uid_base=UID_BASE)
    fn = build_reward_fn("code", None, args)
    honest = "def add(a, b):\n    return a + b"
    samples = [
        Sample(response=f"```python\n{program}\n```", label=label, index=i)
        for i, (program, label) in enumerate(
            [
                (ALWAYS_EQUAL, ASSERTS),
                (FRAME_FORGERY, ASSERTS),
                (ALWAYS_EQUAL, CALLS),
                (honest, ASSERTS),
                (honest, CALLS),
            ]
        )
    ]
    stats = score_samples(samples, fn, args)
    assert stats["num_failed"] == 0
    assert [s.reward for s in samples] == [0.0, 0.0, 0.0, 1.0, 1.0]
