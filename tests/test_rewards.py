"""Rule rewards on hand-checked cases; custom verifiers; the runner's concurrency, timeouts and failure isolation."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import rm_plugins

from lichen.errors import ConfigError
from lichen.rewards import (
    GroupReward,
    RewardHub,
    build_reward_fn,
    get_rule_reward,
    score_samples,
    score_samples_async,
)
from lichen.rewards.math_grader import grade_math as math
from lichen.rewards.rules import exact, extract_answer, last_boxed, leading_number, parse_number
from lichen.types import Sample, Status

# the plug-in module lives beside this file; make it importable whatever pytest's import mode
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def make(response: str, label=None, index: int = 0, **metadata) -> Sample:
    return Sample(prompt="p", response=response, label=label, index=index, metadata=dict(metadata))


# --------------------------------------------------------------------------------------------- rule rewards


@pytest.mark.parametrize(
    "response,label,want",
    [("47", 47, 1.0), (" 47\n", "47", 1.0), ("47.", 47, 0.0), ("", "", 1.0), ("x", None, 0.0)],
)
def test_exact(response, label, want):
    assert exact(response, label, {}) == want


@pytest.mark.parametrize(
    "response,label,want",
    [
        ("47", 47, 1.0),
        ("47</s>", 47, 1.0),
        (" 47abc", 47, 1.0),
        ("-3", -3, 1.0),
        ("-3", 3, 0.0),
        ("4 7", 4, 1.0),  # digits stop at the space
        ("4 7", 47, 0.0),
        ("", 47, 0.0),
        ("abc", 47, 0.0),
        ("abc47", 47, 0.0),  # the number must lead
        ("470", 47, 0.0),
        ("047", "47", 1.0),  # label given as a string; leading zeros are the same integer
        ("- 3", -3, 0.0),
    ],
)
def test_leading_number(response, label, want):
    assert leading_number(response, label, {}) == want


def test_leading_number_bad_label_raises():
    with pytest.raises(ValueError, match="not an integer"):
        leading_number("47", "forty-seven", {})


def test_last_boxed_balances_nested_braces():
    assert last_boxed(r"x \boxed{\frac{1}{\sqrt{2}}} y") == r"\frac{1}{\sqrt{2}}"
    assert last_boxed(r"\boxed{1} then \boxed{2}") == "2"
    assert last_boxed(r"\boxed{3} then \boxed{4") == "3"  # the unbalanced last box is skipped
    assert last_boxed(r"\boxed 7 done") == "7"
    assert last_boxed("no box") is None


def test_extract_answer_falls_back_to_last_number():
    assert extract_answer("first 3 then 1,000 and 12.5.") == "12.5"
    assert extract_answer("total 1,000") == "1,000"
    assert extract_answer("nothing here") is None


@pytest.mark.parametrize(
    "text,want",
    [
        ("0.5", 0.5),
        (r"\frac{1}{2}", 0.5),
        (r"-\frac{3}{4}", -0.75),
        (r"\frac12", 0.5),
        ("3/4", 0.75),
        ("1,000", 1000.0),
        (r"\frac{1}{0}", None),
        (r"\sqrt{2}", None),
        ("1.2.3", None),
        ("nan", None),
    ],
)
def test_parse_number(text, want):
    assert parse_number(text) == want


@pytest.mark.parametrize(
    "response,label,want",
    [
        (r"The answer is \boxed{\frac{1}{2}}.", "0.5", 1.0),
        (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{1}{\sqrt{2}}", 1.0),
        (r"\boxed{\dfrac{1}{\sqrt{2}}}", r"\frac{1}{\sqrt{2}}", 1.0),
        (r"\boxed{42}", "43", 0.0),
        (r"\boxed{42}", "42", 1.0),
        ("so it is 42", 42, 0.0),  # no box: no answer (slime's rule; math_lenient takes the last number)
        ("so it is 42.", "42", 0.0),
        (r"\boxed{41} wait, \boxed{42}", "42", 1.0),  # the last box counts
        (r"\boxed{42} wait, \boxed{41}", "42", 0.0),
        (r"$\boxed{\text{(B)}}$", "(B)", 1.0),
        (r"\boxed{\left( 1, 2 \right)}", "(1,2)", 1.0),
        (r"\boxed{3/4}", r"\tfrac{3}{4}", 1.0),
        (r"\boxed{1,000}", "1000", 1.0),
        (r"\boxed{0.3333333}", r"\frac{1}{3}", 1.0),  # within 1e-6
        (r"\boxed{0.333}", r"\frac{1}{3}", 0.0),
        (r"\boxed{5}", r"\boxed{5}", 1.0),  # a boxed label
        (r"\boxed{5}", "", 0.0),  # empty label
        (r"\boxed{5}", None, 0.0),
        ("no answer at all", "5", 0.0),
    ],
)
def test_math(response, label, want):
    assert math(response, label, {}) == want


def test_get_rule_reward_unknown_lists_known():
    assert get_rule_reward("math") is math
    with pytest.raises(ConfigError) as e:
        get_rule_reward("f1-score")
    msg = str(e.value)
    assert "--rm-type" in msg and "'f1-score'" in msg
    for name in (
        "exact",
        "leading_number",
        "math",
        "dapo",
        "deepscaler",
        "f1",
        "gpqa",
        "code",
        "remote_rm",
        "boxed_f1",
    ):
        assert name in msg


# ------------------------------------------------------------------------------------------ building the fn


def test_rule_wrapper_and_per_sample_override():
    fn = build_reward_fn("leading_number", None, None)
    assert isinstance(fn, RewardHub)
    call = lambda s: asyncio.run(fn(None, s))  # noqa: E731
    assert call(make("47", 47)) == 1.0
    # a sample asking for `exact` is scored by it: "47abc" leads with 47 but is not exactly 47
    assert call(make("47abc", 47)) == 1.0
    assert call(make("47abc", 47, rm_type="exact")) == 0.0
    assert call(make(r"so \boxed{47}", 47, rm_type="boxed_exact")) == 1.0
    with pytest.raises(ValueError, match="rm_type 'bogus'"):
        call(make("47", 47, rm_type="bogus"))
    # through the runner a bad per-sample type fails only that sample
    samples = [make("47", 47, index=0), make("47", 47, index=1, rm_type="bogus")]
    stats = score_samples(samples, fn, None)
    assert samples[0].reward == 1.0 and stats["num_failed"] == 1 and stats["failed"][0][0] == 1


def test_build_reward_fn_errors():
    with pytest.raises(ConfigError, match="--rm-type"):
        build_reward_fn("nope", None, None)
    with pytest.raises(ConfigError, match="--rm-type .*--custom-rm-path"):
        build_reward_fn(None, None, None)
    with pytest.raises(ConfigError, match="--custom-rm-path"):
        build_reward_fn(None, "rm_plugins.does_not_exist", None)


def test_custom_sync_rm_gets_args_and_sample():
    fn = build_reward_fn("math", "rm_plugins.sync_rm", None)  # the custom path wins over --rm-type
    samples = [make("a", "a", index=0), make("b", "c", index=1)]
    t0 = time.perf_counter()
    stats = score_samples(samples, fn, SimpleNamespace(bonus=0.25), concurrency=2, timeout=5.0)
    wall = time.perf_counter() - t0
    assert [s.reward for s in samples] == [1.25, 0.25]
    assert stats["num_failed"] == 0 and stats["failed"] == []
    assert all(s.status == Status.PENDING for s in samples)  # success leaves the status to the generator
    assert 0 < stats["reward_time_s"] <= wall  # the scoring's own time, inside the call's


def test_custom_async_rm_returns_dicts():
    fn = build_reward_fn(None, "rm_plugins.async_rm", None)
    samples = [make("a", "a", index=i) for i in range(3)] + [make("b", "c", index=3)]
    stats = score_samples(samples, fn, None)
    assert [s.reward["score"] for s in samples] == [1.0, 1.0, 1.0, 0.0]
    assert samples[3].reward["pred"] == "b"
    assert stats["num_failed"] == 0


def test_rule_rewards_through_runner():
    fn = build_reward_fn("leading_number", None, None)
    samples = [make(r, 47, index=i) for i, r in enumerate(["47", " 47abc", "4 7", "", "abc"])]
    samples.append(make("47", "x", index=5))  # bad label: the rule raises, the sample fails
    stats = score_samples(samples, fn, None)
    assert [s.reward for s in samples] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert stats["failed"] == [(5, "ValueError: leading_number: label 'x' is not an integer")]


# --------------------------------------------------------------------------------------- failure isolation


def test_failing_verifiers_are_isolated():
    fn = build_reward_fn(None, "rm_plugins.flaky_rm", None)
    modes = ["ok", "raise", "ok", "hang", "nan", "dict_nan", "none", "own_timeout", "ok"]
    samples = [make("r", None, index=10 + i, mode=m) for i, m in enumerate(modes)]
    samples[0].metadata["reward_error"] = "stale"  # from an earlier scoring; success clears it
    finished_before = len(rm_plugins.HANGS_FINISHED)
    stats = score_samples(samples, fn, None, concurrency=4, timeout=0.3)
    # the hung thread sleeps 10 s; the call returns once the 0.3 s timeout fires, while that thread still sleeps
    assert len(rm_plugins.HANGS_FINISHED) == finished_before
    want = {
        11: "ValueError: cannot parse the answer",
        13: "timeout after 0.3 s",
        14: "non-finite reward nan",
        15: "non-finite reward inf at key 'score'",
        16: "TypeError: reward must be a float or a dict, got NoneType",
        17: "TimeoutError: sandbox did not answer",  # the verifier's own timeout is its error, not ours
    }
    assert dict(stats["failed"]) == want
    assert stats["num_failed"] == len(want)
    for s in samples:
        if s.index in want:
            assert s.status == Status.FAILED
            assert s.metadata["reward_error"] == want[s.index]
        else:
            assert s.status == Status.PENDING and s.reward == 1.0
            assert "reward_error" not in s.metadata
    assert samples[1].reward == 0.0 and samples[3].reward == 0.0 and samples[4].reward == 0.0
    assert samples[5].reward == {"score": float("inf"), "pred": "x"}  # the dict is kept for inspection


def test_async_verifier_timeout_is_cancelled():
    fn = build_reward_fn(None, "rm_plugins.async_hang_rm", None)
    samples = [make("r", index=0), make("r", index=1, mode="hang"), make("r", index=2)]
    t0 = time.perf_counter()
    stats = score_samples(samples, fn, None, timeout=0.2)
    assert time.perf_counter() - t0 < 15  # the hang is 30 s: cancelled at the timeout, not awaited
    assert stats["failed"] == [(1, "timeout after 0.2 s")]
    assert samples[0].reward == 0.5 and samples[2].reward == 0.5 and samples[1].reward == 0.0


def test_numpy_and_tensor_scalars_accepted():
    import numpy as np
    import torch

    values = [np.float32(0.5), torch.tensor(0.25), 1, True, np.float64("nan"), torch.tensor([1.0, 2.0])]
    samples = [make("r", index=i) for i in range(len(values))]
    stats = score_samples(samples, lambda args, s: values[s.index], None)
    assert [s.reward for s in samples[:4]] == [0.5, 0.25, 1.0, 1.0]
    assert all(isinstance(s.reward, float) for s in samples[:4])
    failed = dict(stats["failed"])
    assert failed[4] == "non-finite reward nan"
    assert failed[5].startswith("TypeError: reward Tensor is not a scalar")


# ------------------------------------------------------------------------------------------- concurrency


def _tracking_sync(delay: float):
    lock, state = threading.Lock(), {"now": 0, "max": 0}

    def fn(args, sample):
        with lock:
            state["now"] += 1
            state["max"] = max(state["max"], state["now"])
        time.sleep(delay)
        with lock:
            state["now"] -= 1
        return 1.0

    return fn, state


def test_sync_concurrency_limit_respected_and_reached():
    fn, state = _tracking_sync(0.05)
    samples = [make("r", index=i) for i in range(12)]
    t0 = time.perf_counter()
    stats = score_samples(samples, fn, None, concurrency=3, timeout=5.0)
    elapsed = time.perf_counter() - t0
    assert state["max"] == 3
    assert stats["num_failed"] == 0
    assert elapsed >= 4 * 0.05 * 0.9  # 12 calls, 3 at a time: at least 4 rounds


def test_async_concurrency_limit_respected_and_reached():
    state = {"now": 0, "max": 0}

    async def fn(args, sample):
        state["now"] += 1
        state["max"] = max(state["max"], state["now"])
        await asyncio.sleep(0.02)
        state["now"] -= 1
        return 1.0

    samples = [make("r", index=i) for i in range(20)]
    score_samples(samples, fn, None, concurrency=5)
    assert state["max"] == 5
    assert all(s.reward == 1.0 for s in samples)


def test_score_samples_inside_running_loop():
    async def main():
        samples = [make("47", 47)]
        with pytest.raises(RuntimeError, match="score_samples_async"):
            score_samples(samples, RewardHub("exact"), None)
        stats = await score_samples_async(samples, RewardHub("exact"), None)
        return samples[0].reward, stats["num_failed"]

    assert asyncio.run(main()) == (1.0, 0)


def test_bad_runner_arguments():
    with pytest.raises(ValueError, match="concurrency"):
        score_samples([make("x")], RewardHub("exact"), None, concurrency=0)
    with pytest.raises(ValueError, match="timeout"):
        score_samples([make("x")], RewardHub("exact"), None, timeout=0)
    assert score_samples([], RewardHub("exact"), None)["num_failed"] == 0


# ------------------------------------------------------------------------------------ --group-rm, args limits


def group_len_rm(args, samples):
    """--group-rm contract: one call per prompt group; rewards = position in group / group size."""
    CALLS.append([s.index for s in samples])
    return [j / len(samples) for j in range(len(samples))]


async def async_group_rm(args, samples):
    if samples[0].metadata.get("mode") == "raise":
        raise RuntimeError("judge model unavailable")
    if samples[0].metadata.get("mode") == "short":
        return [1.0]
    if samples[0].metadata.get("mode") == "hang":
        await asyncio.sleep(30)
    return [float("nan") if s.metadata.get("nan") else 1.0 for s in samples]


CALLS: list = []


def grouped(n_groups: int, n: int, **metadata_by_group) -> list[Sample]:
    out = []
    for g in range(n_groups):
        for j in range(n):
            meta = dict(metadata_by_group.get(f"g{g}", {}))
            if meta.get("nan_at") == j:
                meta["nan"] = True
            out.append(Sample(response="r", index=g * n + j, group_index=g, metadata=meta))
    return out


def test_group_rm_is_called_once_per_group():
    CALLS.clear()
    args = SimpleNamespace()
    fn = build_reward_fn(None, "test_rewards.group_len_rm", args, group=True)
    assert isinstance(fn, GroupReward)
    samples = grouped(3, 4)
    samples = samples[4:] + samples[:4]  # groups need not arrive in order
    stats = score_samples(samples, fn, args)
    assert stats["num_failed"] == 0
    assert sorted(CALLS) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert [s.reward for s in sorted(samples, key=lambda s: s.index)] == [0.0, 0.25, 0.5, 0.75] * 3


def test_group_rm_failures():
    args = SimpleNamespace()
    fn = build_reward_fn(None, "test_rewards.async_group_rm", args, group=True)
    samples = grouped(5, 2, g1={"mode": "raise"}, g2={"mode": "short"}, g3={"nan_at": 1}, g4={"mode": "hang"})
    stats = score_samples(samples, fn, args, timeout=0.3)
    failed = dict(stats["failed"])
    assert failed == {
        2: "RuntimeError: judge model unavailable",
        3: "RuntimeError: judge model unavailable",
        4: "TypeError: --group-rm function must return one reward per sample (2), got 1 values",
        5: "TypeError: --group-rm function must return one reward per sample (2), got 1 values",
        7: "non-finite reward nan",  # only the sample with the bad value
        8: "timeout after 0.3 s",
        9: "timeout after 0.3 s",
    }
    assert [s.reward for s in samples[:2]] == [1.0, 1.0] and samples[6].reward == 1.0
    assert samples[6].status == Status.PENDING


def test_group_rm_needs_custom_path():
    with pytest.raises(ConfigError, match="--group-rm"):
        build_reward_fn("math", None, None, group=True)


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_each_failure_is_logged_with_index_and_cause():
    fn = build_reward_fn(None, "rm_plugins.flaky_rm", None)
    samples = [make("r", index=i, mode="raise" if i % 2 else "ok") for i in range(6)]
    # a handler of our own: lichen's logger does not propagate to the root logger that caplog watches
    handler, logger = _Collect(), logging.getLogger("lichen.rewards.runner")
    logger.addHandler(handler)
    try:
        score_samples(samples, fn, None)
    finally:
        logger.removeHandler(handler)
    text = "\n".join(handler.lines)
    assert "reward failed for 3 of 6 samples" in text
    for i in (1, 3, 5):
        assert f"sample {i}: ValueError: cannot parse the answer" in text


# ---------------------------------------------------------------------- verifiers that exit or blow up


@pytest.mark.parametrize("name", ["rm_plugins.base_exception_rm", "rm_plugins.async_base_exception_rm"])
def test_base_exceptions_and_huge_rewards_fail_only_their_sample(name):
    fn = build_reward_fn(None, name, None)
    modes = ["ok", "exit", "odd", "generator_exit", "cancel", "huge", "dict_huge", "big_but_fine"]
    samples = [make("r", index=i, mode=m) for i, m in enumerate(modes)]
    stats = score_samples(samples, fn, None)
    assert dict(stats["failed"]) == {
        1: "SystemExit: the verifier exited (code 3)",
        2: "OddError: not an Exception",
        3: "GeneratorExit: ",
        4: "CancelledError: the verifier cancelled itself",
        5: "reward 1e+308 is out of range (|reward| must be at most 1e+15)",
        6: "reward -1e+16 is out of range (|reward| must be at most 1e+15) at key 'score'",
    }
    assert [s.status == Status.FAILED for s in samples] == [False, True, True, True, True, True, True, False]
    assert samples[0].reward == 1.0 and samples[5].reward == 0.0 and samples[7].reward == 1e15


@pytest.mark.parametrize("name", ["rm_plugins.base_exception_rm", "rm_plugins.async_base_exception_rm"])
def test_keyboard_interrupt_in_a_verifier_still_stops_the_run(name, caplog):
    fn = build_reward_fn(None, name, None)
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        with pytest.raises(KeyboardInterrupt):
            score_samples([make("r", index=0), make("r", index=1, mode="interrupt")], fn, None)
        gc.collect()
    # it stops the run without asyncio's "Task exception was never retrieved" traceback of the verifier's task
    assert not [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()]


def test_cancelling_the_batch_still_cancels():
    # the runner turns a verifier's own CancelledError into a failure; a cancellation of the caller stays one
    fn = build_reward_fn(None, "rm_plugins.async_hang_rm", None)

    async def main():
        task = asyncio.ensure_future(score_samples_async([make("r", mode="hang")], fn, None, timeout=None))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_huge_rewards_never_reach_the_advantages():
    import torch

    from lichen import algo
    from lichen.train.advantage import sample_rewards

    fn = build_reward_fn(None, "rm_plugins.base_exception_rm", None)
    samples = [make("r", index=i, mode=m) for i, m in enumerate(["ok", "huge", "big_but_fine", "ok"])]
    for s in samples:
        s.group_index = 0
    score_samples(samples, fn, None)
    valid = torch.tensor([s.status != Status.FAILED for s in samples])
    adv, _ = algo.group_normalized_rewards(
        sample_rewards(samples, None), torch.zeros(4, dtype=torch.long), valid, normalize=True, std_normalize=True
    )
    assert torch.isfinite(adv).all(), adv
