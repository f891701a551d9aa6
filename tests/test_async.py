"""`lichen train --async` (lichen/loop_async.py, docs/async.md): one-step off-policy pipelining.

The driver-level tests use a fake rollout and trainer that block on each other, so the overlap is shown by
events, not by timing; the runs launch one `lichen serve` (--rollout-num-engines 1) like a user would.
"""

from __future__ import annotations

import threading

import pytest
import torch
from helpers.async_driver import WAIT, assert_side_error, assert_threads_end, run_driver
from helpers.runs import THREADS, base_args, dumped_samples, final_weights, run, run_stopped_after_sync

from lichen.cli import main
from lichen.config import parse_train_args
from lichen.errors import ConfigError
from lichen.loop import NullTrainer
from lichen.loop_async import train_loop_async
from lichen.rollout.generate import generate_rollout
from lichen.types import Sample, Status


# ---- flags ---------------------------------------------------------------------------------------------------
def _parse(ckpt, data, tmp_path, *extra):
    return parse_train_args(base_args(ckpt, data, tmp_path, "--num-rollout", "2")[1:] + list(extra))


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "--async needs server engines"),
        (["--rollout-num-engines", "1", "--colocate"], "--async is refused with --colocate"),
        (["--rollout-num-engines", "1", "--offload-rollout"], "--async is refused with --offload-rollout"),
        (
            ["--rollout-num-engines", "1", "--update-weights-interval", "2", "--save", "s", "--save-interval", "3"],
            "--save-interval 3 with --async: give a multiple of --update-weights-interval 2",
        ),
        (["--rollout-num-engines", "1", "--update-weights-interval", "0"], "--update-weights-interval"),
    ],
)
def test_async_refusals(tiny_ckpt, addition_data, tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        _parse(tiny_ckpt, addition_data, tmp_path, "--async", *extra)


def test_interval_needs_async_and_cli_exit_code(tiny_ckpt, addition_data, tmp_path, capsys):
    with pytest.raises(ConfigError, match="--update-weights-interval 2 needs --async"):
        _parse(tiny_ckpt, addition_data, tmp_path, "--update-weights-interval", "2")
    assert main(base_args(tiny_ckpt, addition_data, tmp_path, "--num-rollout", "2", "--async")) == 2
    err = capsys.readouterr().err
    assert "in-process engine" in err and "Traceback" not in err
    args = _parse(
        tiny_ckpt,
        addition_data,
        tmp_path,
        "--async",
        "--rollout-num-engines",
        "1",
        "--update-weights-interval",
        "2",
        "--save",
        "s",
        "--save-interval",
        "4",
    )
    assert args.async_train and args.update_weights_interval == 2


# ---- the driver with fakes -------------------------------------------------------------------------------------
class FakeEngine:
    """Serves a weight version; the rollout stamps each sample with the version it was generated with."""

    def __init__(self):
        self.weight_version = "default"
        self.log: list[tuple[str, int | str]] = []

    def update_weights_from_tensors(self, named, version: str) -> None:
        self.log.append(("sync", version))
        self.weight_version = version


class FakeRollout:
    def __init__(self, engine: FakeEngine, started: dict[int, threading.Event], fail_at: int | None = None):
        self.engine, self.started, self.fail_at = engine, started, fail_at
        self.position = 0
        self.args = None

    @property
    def engines(self):
        return [self.engine]

    def generate(self, rollout_id: int):
        version = self.engine.weight_version
        self.engine.log.append(("generate", rollout_id))
        self.started.setdefault(rollout_id, threading.Event()).set()
        if rollout_id == self.fail_at:
            raise ValueError("engine exploded")
        self.position += 1
        s = Sample(
            tokens=[1, 2, 3],
            response_length=1,
            reward=1.0,
            status=Status.COMPLETED,
            weight_versions=[version],
            index=rollout_id,
        )
        return [[s]], {"rollout/reward_mean": 1.0}

    def eval(self, version):
        return {}

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class FakeTrainer(NullTrainer):  # the rest of the Trainer contract: no-ops
    """train(k) does not return before generation of rollout k+1 has begun: a sequential driver would hang here
    (and fail after WAIT seconds), a pipelined one passes at once."""

    def __init__(self, started: dict[int, threading.Event], num_rollout: int, fail_at: int | None = None):
        self.started, self.num_rollout, self.fail_at = started, num_rollout, fail_at
        self.batches: list[tuple[int, list[str]]] = []

    def named_weights(self):
        return iter([("w", torch.zeros(1))])

    def train(self, rollout_id, batch):
        self.batches.append((rollout_id, [v for g in batch for s in g for v in s.weight_versions]))
        if rollout_id == self.fail_at:
            raise ValueError("loss is nan")
        if rollout_id + 1 < self.num_rollout:
            event = self.started.setdefault(rollout_id + 1, threading.Event())
            assert event.wait(WAIT), f"rollout {rollout_id + 1} did not start while step {rollout_id} trained"
        return {}


def _fake_run(tiny_ckpt, addition_data, tmp_path, num_rollout, *extra, rollout_fail=None, train_fail=None):
    args = _parse(
        tiny_ckpt,
        addition_data,
        tmp_path,
        "--async",
        "--rollout-num-engines",
        "1",
        "--num-rollout",
        str(num_rollout),
        *extra,
    )
    started: dict[int, threading.Event] = {}
    engine = FakeEngine()
    rollout = FakeRollout(engine, started, rollout_fail)
    trainer = FakeTrainer(started, num_rollout, train_fail)
    return engine, trainer, run_driver(train_loop_async, args, trainer, rollout)


def test_rollout_k_plus_1_is_generated_with_version_k(tiny_ckpt, addition_data, tmp_path):
    engine, trainer, logger = _fake_run(tiny_ckpt, addition_data, tmp_path, 4)
    # each train step sees the samples of the version one behind it (step 0: the start weights)
    assert trainer.batches == [(0, ["0"]), (1, ["0"]), (2, ["1"]), (3, ["2"])]
    # generation k+1 starts before sync k+1, and every sync waits for the generation in flight
    assert engine.log == [
        ("sync", "0"),
        ("generate", 0),
        ("generate", 1),
        ("sync", "1"),
        ("generate", 2),
        ("sync", "2"),
        ("generate", 3),
        ("sync", "3"),
        ("sync", "4"),
    ]
    assert [logger.steps[k]["train/staleness_max"] for k in (1, 2, 3, 4)] == [0, 1, 1, 1]
    assert logger.steps[4]["sync/weight_version"] == 4


def test_update_weights_interval_bounds_staleness(tiny_ckpt, addition_data, tmp_path):
    engine, trainer, logger = _fake_run(tiny_ckpt, addition_data, tmp_path, 6, "--update-weights-interval", "2")
    assert [v for kind, v in engine.log if kind == "sync"] == ["0", "2", "4", "6"]
    assert trainer.batches == [(0, ["0"]), (1, ["0"]), (2, ["0"]), (3, ["2"]), (4, ["2"]), (5, ["4"])]
    staleness = [logger.steps[k]["train/staleness_max"] for k in range(1, 7)]
    assert staleness == [0, 1, 2, 1, 2, 1] and max(staleness) <= 2


@pytest.mark.parametrize("side", ["rollout", "trainer"])
def test_an_error_on_one_side_is_named_and_stops_both(tiny_ckpt, addition_data, tmp_path, side):
    kw = {"rollout_fail": 2} if side == "rollout" else {"train_fail": 1}
    assert_side_error(
        lambda: _fake_run(tiny_ckpt, addition_data, tmp_path, 4, **kw),
        side,
        "engine exploded" if side == "rollout" else "loss is nan",
        "lichen-async-rollout",
    )


# ---- runs over a launched server -------------------------------------------------------------------------------
def _dump(path_template: str, rollout_id: int) -> list[dict]:
    return dumped_samples(path_template.format(rollout_id=rollout_id))


@pytest.mark.slow
def test_async_run_over_a_server(tiny_ckpt, addition_data, tmp_path, launched):
    dump = str(tmp_path / "d" / "r_{rollout_id}.pt")
    metrics = run(
        base_args(
            tiny_ckpt,
            addition_data,
            tmp_path / "o",
            "--num-rollout",
            "3",
            "--async",
            "--rollout-num-engines",
            "1",
            "--save-debug-rollout-data",
            dump,
            *THREADS,
        )
    )
    for k in range(3):
        versions = [s["weight_versions"] for s in _dump(dump, k)]
        assert versions == [[str(max(k - 1, 0))]] * 16  # one version per sample: no request straddles a sync
    assert [m["train/staleness_max"] for m in metrics] == [0, 1, 1]
    assert [m["sync/weight_version"] for m in metrics] == [1, 2, 3]
    assert len(launched) == 1 and not any(launched[0].alive())


@pytest.mark.slow
def test_async_exact_resume(tiny_ckpt, addition_data, tmp_path, launched):
    """4 steps == 2 steps + save + --load + 2 steps with --async: the checkpoint holds the generated rollout 2
    (made with version 1 before the save), so the resumed run trains on the same samples."""
    common = [
        "--micro-batch-size",
        "2",
        "--rollout-shuffle",
        "--save-interval",
        "2",
        "--num-rollout",
        "4",
        "--async",
        "--rollout-num-engines",
        "1",
        *THREADS,
    ]
    straight = run(base_args(tiny_ckpt, addition_data, tmp_path / "a", "--save", str(tmp_path / "ca"), *common))
    run_stopped_after_sync(
        base_args(tiny_ckpt, addition_data, tmp_path / "b", "--save", str(tmp_path / "cb"), *common), stop_at=2
    )
    resumed = run(
        base_args(
            tiny_ckpt,
            addition_data,
            tmp_path / "b",
            "--save",
            str(tmp_path / "cb"),
            "--load",
            str(tmp_path / "cb"),
            *common,
        )
    )
    tail = [m for m in resumed if m["step"] > 2]
    assert [m["step"] for m in tail] == [3, 4]
    for a, b in zip(straight[2:], tail):
        for key in ("rollout/reward_mean", "rollout/response_length_mean", "train/loss", "train/staleness_max"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), key
    wa, wb = final_weights(tmp_path / "ca"), final_weights(tmp_path / "cb")
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= 1e-6
    assert all(not any(x.alive()) for x in launched)


def failing_rollout(args, rollout_id, data_source, evaluation=False):
    if rollout_id == 1:  # generated on the background thread while step 0 trains
        raise RuntimeError("rollout plug-in failed")
    return generate_rollout(args, rollout_id, data_source, evaluation=evaluation)


@pytest.mark.slow
def test_rollout_side_error_stops_the_servers(tiny_ckpt, addition_data, tmp_path, launched, capsys):
    argv = base_args(
        tiny_ckpt,
        addition_data,
        tmp_path / "o",
        "--num-rollout",
        "3",
        "--async",
        *THREADS,
        "--rollout-num-engines",
        "1",
        "--rollout-function-path",
        "test_async.failing_rollout",
    )
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "the rollout side failed at rollout step 1" in err and "rollout plug-in failed" in err
    assert len(launched) == 1 and not any(launched[0].alive())


@pytest.mark.slow
def test_trainer_side_error_stops_the_servers_and_the_generation(
    tiny_ckpt, addition_data, tmp_path, launched, monkeypatch, capsys
):
    from lichen.train.actor import TrainActor

    train = TrainActor.train

    def failing_train(self, rollout_id, batch):
        if rollout_id == 1:  # rollout 2 is being generated on the background thread meanwhile
            raise RuntimeError("optimizer blew up")
        return train(self, rollout_id, batch)

    monkeypatch.setattr(TrainActor, "train", failing_train)
    argv = base_args(
        tiny_ckpt,
        addition_data,
        tmp_path / "o",
        "--num-rollout",
        "4",
        "--async",
        *THREADS,
        "--rollout-num-engines",
        "1",
    )
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "the trainer side failed at rollout step 1" in err and "optimizer blew up" in err
    assert len(launched) == 1 and not any(launched[0].alive())
    assert_threads_end("lichen-async-rollout")  # after the servers stopped
