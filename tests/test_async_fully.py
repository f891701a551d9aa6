"""`lichen train --fully-async` (lichen/rollout/fully_async.py, docs/async.md): a long-lived rollout worker.

The driver tests run the real worker and driver over `HoldingEngine`, an in-process stand-in for engine servers
whose behaviour is decided by conditions, never by timing: every other group's requests hang until they are
aborted (or, as a server that ignored the sync would, until the next weight update, which counts as a request
straddling the sync). The resume test runs `lichen train` over one launched `lichen serve`.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Callable

import pytest
import torch
from helpers.async_driver import assert_side_error, run_driver
from helpers.runs import THREADS, base_args, dumped_samples, run
from helpers.waits import wait_for

from lichen.config import parse_train_args
from lichen.config.rollout_config import RolloutConfig
from lichen.engines.core.engine import GenResult
from lichen.errors import ConfigError
from lichen.loop import NullTrainer
from lichen.loop_async import train_loop_fully_async
from lichen.rollout.manager import RolloutManager
from lichen.rollout.partial import segments_of
from lichen.train import checkpoint as ckpt


def _parse(ckpt_dir, data, tmp_path, *extra):
    return parse_train_args(base_args(ckpt_dir, data, tmp_path, "--num-rollout", "2")[1:] + list(extra))


# ---- flags ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "extra, message",
    [
        (["--fully-async"], "--fully-async needs server engines"),
        (["--max-staleness", "1", "--rollout-num-engines", "1"], "--max-staleness 1 needs --fully-async"),
        (["--fully-async", "--async", "--rollout-num-engines", "1"], "two different drivers"),
        (
            ["--fully-async", "--rollout-num-engines", "1", "--rollout-function-path", "loop_plugins.constant_rollout"],
            "--fully-async is refused with --rollout-function-path",
        ),
        (["--fully-async", "--rollout-num-engines", "1", "--colocate"], "--fully-async is refused with --colocate"),
        (["--fully-async", "--rollout-num-engines", "1", "--max-staleness", "-1"], "--max-staleness"),
    ],
)
def test_fully_async_refusals(tiny_ckpt, addition_data, tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        _parse(tiny_ckpt, addition_data, tmp_path, *extra)


# ---- the worker and driver over an in-process engine ------------------------------------------------------------
class HoldingEngine:
    """Engine servers as the worker sees them (agenerate / submit / abort_all on an event loop of their own).

    One group at a time is held: when a new group's first request arrives and no group is held, its requests
    generate one token and hang; abort_all ends them with finish "abort" and that token. A weight update also
    ends them, with "length": such a request ran under two versions and is recorded in `straddled`. Every other
    request answers at once with two tokens, including the continuation of an aborted one, so the worker (two
    groups on the engines at most here) always has one that finishes. `fail_at`: the n-th fresh request raises."""

    def __init__(self, n_samples: int, fail_at: int | None = None):
        self.n, self.fail_at = n_samples, fail_at
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.weight_version = "default"
        self.clients: list = []
        self.fresh = 0
        self.held_group: int | None = None
        self.held: list[asyncio.Future] = []
        self.straddled: list[tuple[str, str]] = []
        self.aborted_inputs: set[tuple[int, ...]] = set()
        self.served: list[tuple[str, str]] = []  # (version, finish) per answered request

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def agenerate(self, request, session_id=None, *, allow_abort=False):
        version = self.weight_version
        ids = tuple(request.input_ids)
        if ids in self.aborted_inputs:  # a continuation
            out, finish = [11, 12][: request.max_new_tokens], "length"
        else:
            group, self.fresh = self.fresh // self.n, self.fresh + 1
            if self.fail_at is not None and self.fresh >= self.fail_at:
                raise RuntimeError("engine exploded")
            if self.held_group is None and self.fresh % self.n == 1:
                self.held_group = group
            if group == self.held_group:
                fut = self.loop.create_future()
                self.held.append(fut)
                finish = await fut
                out = [9] if finish == "abort" else [9, 10]
                if finish == "abort":
                    self.aborted_inputs.add(ids + (9,))
            else:
                out, finish = [9, 10], "length"
        await asyncio.sleep(0)
        if self.weight_version != version:
            self.straddled.append((version, self.weight_version))
        self.served.append((version, finish))
        return GenResult(out, [-0.5] * len(out), finish, len(ids), version)

    def _release(self, finish: str) -> None:
        held, self.held, self.held_group = self.held, [], None
        for fut in held:
            if not fut.done():
                fut.set_result(finish)

    def abort_all(self) -> None:
        self.loop.call_soon_threadsafe(self._release, "abort")
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self.loop).result()

    def update_weights_from_tensors(self, named, version: str) -> None:
        self.weight_version = version
        self.loop.call_soon_threadsafe(self._release, "length")
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self.loop).result()

    def generate(self, requests):
        raise AssertionError("the fully async worker sends each request with agenerate")

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


class FakeTrainer(NullTrainer):  # saves no trainer files: the worker's state is what these tests look at
    def __init__(self, fail_at: int | None = None, before_train: Callable[[int], None] | None = None):
        self.fail_at, self.before_train = fail_at, before_train
        self.batches: list[list[list]] = []

    def named_weights(self):
        return iter([("w", torch.zeros(1))])

    def train(self, rollout_id, batch):
        if self.before_train is not None:
            self.before_train(rollout_id)
        if rollout_id == self.fail_at:
            raise ValueError("loss is nan")
        self.batches.append(batch)
        return {}


def keep_even_prompts(args, group) -> bool:
    return group[0].metadata["prompt_index"] % 2 == 0


def _drive(
    tiny_ckpt, addition_data, tmp_path, num_rollout, *extra, engine_fail=None, train_fail=None, engine=None, before=None
):
    args = _parse(
        tiny_ckpt,
        addition_data,
        tmp_path,
        "--fully-async",
        "--rollout-num-engines",
        "1",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        *extra,
    )
    args.num_rollout = num_rollout
    engine = engine or HoldingEngine(args.n_samples_per_prompt, engine_fail)
    manager = RolloutManager(RolloutConfig.from_args(args), args, engine)
    trainer = FakeTrainer(train_fail, before and (lambda rollout_id: before(engine, rollout_id)))
    return engine, trainer, run_driver(train_loop_fully_async, args, trainer, manager)


def _prompts(groups) -> list[int]:
    return [
        g[0]["metadata"]["prompt_index"] if isinstance(g[0], dict) else g[0].metadata["prompt_index"] for g in groups
    ]


def test_no_request_straddles_a_sync(tiny_ckpt, addition_data, tmp_path):
    engine, trainer, logger = _drive(tiny_ckpt, addition_data, tmp_path, 4)
    assert engine.straddled == []  # every hanging request was aborted before its weight update
    samples = [s for batch in trainer.batches for g in batch for s in g]
    assert len(trainer.batches) == 4 and all(len(b) == 2 for b in trainer.batches)
    resumed = [s for s in samples if len(s.weight_versions) > 1]
    assert resumed, "no group was cut at a sync and continued"
    for s in samples:  # one version per segment, each segment one request
        assert len(segments_of(s)) == len(s.weight_versions) and sum(segments_of(s)) == s.response_length
    for s in resumed:
        assert s.weight_versions[0] != s.weight_versions[-1]
        assert s.rollout_log_probs == [-0.5] * s.response_length
    assert sum(logger.steps[k]["rollout/fully_async_aborted_requests"] for k in logger.steps) > 0
    assert max(logger.steps[k]["train/staleness_max"] for k in logger.steps) >= 1


@pytest.mark.parametrize("action", ["drop", "mask"])
def test_max_staleness_drops_or_masks_and_counts(tiny_ckpt, addition_data, tmp_path, action):
    engine, trainer, logger = _drive(
        tiny_ckpt, addition_data, tmp_path, 4, "--max-staleness", "0", "--max-staleness-action", action
    )
    key = "rollout/fully_async_stale_dropped" if action == "drop" else "rollout/fully_async_stale_masked"
    counted = sum(m[key] for m in logger.steps.values())
    assert counted > 0
    lags = [
        (k, g)
        for k, batch in enumerate(trainer.batches)
        for g in batch
        if any(k - min(int(v) for v in s.weight_versions) > 0 for s in g)
    ]
    if action == "drop":
        assert lags == [] and all(m["train/staleness_max"] == 0 for m in logger.steps.values())
    else:
        assert len(lags) == counted  # every stale group trained, with nothing to learn from
        assert all(s.loss_mask == [0] * s.response_length for _, g in lags for s in g)
        stale = {id(g) for _, g in lags}
        assert all(any(1 in s.loss_mask for s in g) for batch in trainer.batches for g in batch if id(g) not in stale)


def test_dynamic_sampling_filter_with_fully_async(tiny_ckpt, addition_data, tmp_path):
    engine, trainer, logger = _drive(
        tiny_ckpt, addition_data, tmp_path, 3, "--dynamic-sampling-filter-path", "test_async_fully.keep_even_prompts"
    )
    trained = [g[0].metadata["prompt_index"] for batch in trainer.batches for g in batch]
    assert len(trained) == 6 and all(i % 2 == 0 for i in trained) and len(set(trained)) == 6
    assert sum(m["rollout/dynamic_sampling_dropped_groups"] for m in logger.steps.values()) >= 2
    assert sum(m["rollout/dynamic_sampling_passed_groups"] for m in logger.steps.values()) >= 6


@pytest.mark.parametrize("side", ["rollout", "trainer"])
def test_an_error_on_one_side_is_named_and_stops_both(tiny_ckpt, addition_data, tmp_path, side):
    kw = {"engine_fail": 9} if side == "rollout" else {"train_fail": 1}
    assert_side_error(
        lambda: _drive(tiny_ckpt, addition_data, tmp_path, 6, **kw),
        side,
        "engine exploded" if side == "rollout" else "loss is nan",
        "lichen-fully-async-rollout",
    )


def test_resume_keeps_the_cut_groups_and_loses_no_prompt(tiny_ckpt, addition_data, tmp_path):
    """2 steps + save, then load + 2 steps: the checkpoint holds groups cut at the sync (partial tokens) and
    finished ones; every prompt handed out is trained once or held at the end, none twice, none missing."""
    save = ["--save", str(tmp_path / "c")]

    def hold_one_at_the_save(engine: HoldingEngine, rollout_id: int) -> None:
        # the worker starts its next group while the trainer trains; under load it may not have by the time the
        # driver pauses it for the checkpoint: the last step trains only once a group hangs on the engine
        if rollout_id == 1:
            wait_for(lambda: engine.held, what="a group held on the engine before the checkpoint")

    engine, first, _ = _drive(tiny_ckpt, addition_data, tmp_path / "a", 2, *save, before=hold_one_at_the_save)
    at_save = ckpt.load_rollout_state(str(tmp_path / "c"), 1)
    assert at_save["partial_rollout"]["groups"], "no group was in flight at the checkpoint"
    _, second, _ = _drive(
        tiny_ckpt, addition_data, tmp_path / "b", 4, *save, "--load", str(tmp_path / "c"), engine=engine
    )  # the same engine: it recognises the continuations of its aborts
    trained = _prompts(g for batch in first.batches + second.batches for g in batch)
    end = ckpt.load_rollout_state(str(tmp_path / "c"), 3)
    held = _prompts(end["fully_async"]["ready"]) + _prompts(end["partial_rollout"]["groups"])
    assert len(trained) == 8 and len(set(trained)) == 8
    assert sorted(trained + held) == list(range(end["fully_async"]["totals"]["consumed"]))
    assert set(_prompts(at_save["partial_rollout"]["groups"])) <= set(trained + held)


# ---- a run over a launched server, saved and resumed -----------------------------------------------------------
@pytest.mark.slow
def test_fully_async_resume_loses_and_repeats_no_prompt(tiny_ckpt, addition_data, tmp_path, launched):
    """2 steps + save, then --load and 2 more: every prompt the data position has handed out is trained once or
    still held in the final checkpoint (ready or partial), none twice, none missing."""
    dump = str(tmp_path / "d" / "r_{rollout_id}.pt")
    save = str(tmp_path / "ckpt")
    common = [
        "--fully-async",
        "--rollout-num-engines",
        "1",
        "--save",
        save,
        "--save-debug-rollout-data",
        dump,
        *THREADS,
    ]
    first = run(base_args(tiny_ckpt, addition_data, tmp_path / "a", "--num-rollout", "2", *common))
    second = run(base_args(tiny_ckpt, addition_data, tmp_path / "b", "--num-rollout", "4", "--load", save, *common))
    assert [m["step"] for m in first if "train/loss" in m] == [1, 2]
    assert [m["step"] for m in second if "train/loss" in m] == [3, 4]
    for m in first + second:  # the off-policy picture of every step
        assert {
            "train/staleness_mean",
            "train/staleness_max",
            "train/train_rollout_logprob_abs_diff",
            "rollout/fully_async_stale_dropped",
            "rollout/fully_async_aborted_requests",
        } <= set(m), m["step"]
    trained = [
        s["metadata"]["prompt_index"]
        for k in range(4)
        for s in dumped_samples(dump.format(rollout_id=k))
        if s["index"] % 4 == 0
    ]  # one sample per group (4 samples per prompt)
    state = ckpt.load_rollout_state(save, 3)
    held = [g[0]["metadata"]["prompt_index"] for g in state["fully_async"]["ready"]]
    held += [g[0]["metadata"]["prompt_index"] for g in state["partial_rollout"]["groups"]]
    consumed = state["fully_async"]["totals"]["consumed"]
    assert len(trained) == 16 and len(set(trained)) == 16  # no prompt trained twice
    assert sorted(trained + held) == list(range(consumed))  # and none lost (the prompts are in file order)
    assert state["source"]["offset"] == consumed
    assert len(launched) == 2 and not any(x for e in launched for x in e.alive())
