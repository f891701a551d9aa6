"""Tests for lichen.observe: metrics sinks, read-back, step line, logger, progress bars."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import sys
import types

import numpy as np
import pytest
import torch

from lichen.errors import ConfigError, DataError
from lichen.observe import MetricsLogger, format_step_line, get_logger, print_line, progress, read_metrics


def _strict_json(line: str) -> dict:
    def reject(token: str) -> None:
        raise AssertionError(f"non-standard JSON constant {token} in {line!r}")

    return json.loads(line, parse_constant=reject)


def test_jsonl_lines_prefixes_and_flush(tmp_path):
    logger = MetricsLogger(str(tmp_path / "run"))
    logger.log(0, {"reward_mean": 0.5, "n": 3}, prefix="rollout")
    logger.log(0, {"train/loss": -0.25})
    # Flushed on every call: readable before close.
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [_strict_json(ln) for ln in lines] == [
        {"step": 0, "rollout/reward_mean": 0.5, "rollout/n": 3},
        {"step": 0, "train/loss": -0.25},
    ]
    logger.log(1, {"ok": True, "np": np.float32(0.5), "t": torch.tensor(2.0), "i": np.int64(7)}, prefix="x")
    logger.close()
    logger.close()  # idempotent
    last = _strict_json((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last == {"step": 1, "x/ok": 1, "x/np": 0.5, "x/t": 2.0, "x/i": 7}
    assert isinstance(last["x/i"], int) and isinstance(last["x/t"], float)
    with pytest.raises(RuntimeError, match="closed"):
        logger.log(2, {"a": 1.0})


def test_appends_across_loggers_and_context_manager(tmp_path):
    with MetricsLogger(str(tmp_path)) as m:
        m.log(0, {"a": 1.0})
    with MetricsLogger(str(tmp_path)) as m:  # a resumed run continues the same file
        m.log(1, {"a": 2.0})
    assert read_metrics(str(tmp_path)) == [{"step": 0, "a": 1.0}, {"step": 1, "a": 2.0}]


def test_non_finite_values_written_as_null(tmp_path):
    with MetricsLogger(str(tmp_path)) as m:
        m.log(
            4,
            {"nan": float("nan"), "inf": float("inf"), "ninf": -math.inf, "t": torch.tensor(float("nan")), "fine": 1.5},
        )
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert _strict_json(line) == {"step": 4, "nan": None, "inf": None, "ninf": None, "t": None, "fine": 1.5}
    assert read_metrics(str(tmp_path / "metrics.jsonl"))[0]["nan"] is None


def test_bad_metric_values(tmp_path):
    with MetricsLogger(str(tmp_path)) as m:
        with pytest.raises(TypeError, match="'p/name'"):
            m.log(0, {"name": "abc"}, prefix="p")
        with pytest.raises(ValueError, match="reserved"):
            m.log(0, {"step": 3})
    assert (tmp_path / "metrics.jsonl").read_text() == ""  # nothing half-written


def test_read_metrics_torn_last_line_and_bad_middle_line(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 0, "a": 1}\n{"step": 1, "a": 2}\n{"step": 2, "a"')
    assert read_metrics(str(p)) == [{"step": 0, "a": 1}, {"step": 1, "a": 2}]
    p.write_text('{"step": 0}\n{"step": 1, oops}\n{"step": 2}\n')
    with pytest.raises(DataError, match="line 2"):
        read_metrics(str(p))
    p.write_text('{"step": 0}\n[1, 2]\n')
    with pytest.raises(DataError, match="line 2"):
        read_metrics(str(p))
    with pytest.raises(DataError, match="does-not-exist"):
        read_metrics(str(tmp_path / "does-not-exist"))


def test_tensorboard_scalars_readable(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(str(tmp_path), use_tensorboard=True) as m:
        for step in range(3):
            m.log(step, {"loss": 0.5 - 0.125 * step, "kl": float("nan") if step == 1 else 0.01 * step}, prefix="train")
    tb_dir = tmp_path / "tensorboard"
    assert any(f.name.startswith("events.out.tfevents") for f in tb_dir.iterdir())
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    assert {"train/loss", "train/kl"} <= set(acc.Tags()["scalars"])
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [0, 1, 2]
    assert [e.value for e in loss] == [0.5, 0.375, 0.25]  # exact in float32
    kl = acc.Scalars("train/kl")
    assert math.isnan(kl[1].value) and kl[2].value == pytest.approx(0.02, rel=1e-6)


class _FakeRun:
    def __init__(self, **kwargs):
        self.init_kwargs = kwargs
        self.logged: list[tuple[dict, int]] = []
        self.finished = 0

    def log(self, data, step=None):
        self.logged.append((dict(data), step))

    def finish(self):
        self.finished += 1


def _fake_wandb() -> types.ModuleType:
    mod = types.ModuleType("wandb")
    mod.runs = []

    def init(**kwargs):
        run = _FakeRun(**kwargs)
        mod.runs.append(run)
        return run

    mod.init = init
    return mod


def test_wandb_missing_gives_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(ConfigError, match="pip install wandb") as info:
        MetricsLogger(str(tmp_path / "run"), use_wandb=True)
    assert "wandb" in str(info.value) and "extra" in str(info.value)
    assert not (tmp_path / "run").exists()  # failed before creating anything


def test_wandb_bad_mode(tmp_path):
    with pytest.raises(ConfigError, match="--wandb-mode"):
        MetricsLogger(str(tmp_path), use_wandb=True, wandb_mode="sometimes")


def test_wandb_offline_calls(tmp_path, monkeypatch):
    fake = _fake_wandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    out = str(tmp_path / "run")
    with MetricsLogger(out, use_wandb=True, wandb_project="proj", wandb_run_name="r1", config={"lr": 1e-6}) as m:
        m.log(5, {"reward_mean": float("nan"), "n": 2}, prefix="rollout")
    (run,) = fake.runs
    assert run.init_kwargs == {"project": "proj", "name": "r1", "mode": "offline", "dir": out, "config": {"lr": 1e-6}}
    ((data, step),) = run.logged
    assert step == 5 and data["rollout/n"] == 2 and math.isnan(data["rollout/reward_mean"])
    assert run.finished == 1


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb not installed")
def test_real_wandb_offline(tmp_path, monkeypatch):  # pragma: no cover - only where wandb is installed
    monkeypatch.setenv("WANDB_SILENT", "true")
    with MetricsLogger(str(tmp_path), use_wandb=True, wandb_mode="offline") as m:
        m.log(0, {"a": 1.0})
    assert (tmp_path / "wandb").is_dir()


def test_format_step_line_full():
    metrics = {
        "num_rollout": 20,
        "rollout/reward_mean": 0.41234,
        "rollout/response_length_mean": 7.875,
        "train/loss": -0.0123,
        "train/pg_clipfrac": 0.0,
        "train/ppo_kl": 0.0,
        "train/train_rollout_logprob_abs_diff": 2.1e-7,
        "eval/gsm8k/reward_mean": 0.5,
        "eval/math/reward_mean": 0.25,
        "time/generate": 3.21,
        "time/train": 1.149,
        "time/sync": 0.0123,
        "train/unrelated": 99.0,
    }
    assert format_step_line(2, metrics) == (
        "step 3/20 | reward 0.412 | resp_len 7.9 | loss -0.012 | clipfrac 0.000 | ppo_kl 0.0e+00 | "
        "lp_diff 2.1e-07 | eval gsm8k 0.500 | eval math 0.250 | gen 3.2s train 1.1s sync 0.01s"
    )


def test_format_step_line_partial():
    assert format_step_line(0, {}) == "step 1"
    assert format_step_line(4, {"rollout/reward_mean": 1, "time/train": 250.4, "train/loss": None}) == (
        "step 5 | reward 1.000 | train 250s"
    )
    assert format_step_line(0, {"train/ppo_kl": float("nan"), "num_rollout": 1}) == "step 1/1 | ppo_kl nan"
    assert format_step_line(0, {"rollout/response_length_mean": 20.25, "rollout/tool_call_ratio": 0.3}) == (
        "step 1 | resp_len 20.2 | tool_calls 0.30"
    )


def test_get_logger_format_and_single_handler(capsys):
    log = get_logger("rollout")
    assert log.name == "lichen.rollout"
    assert get_logger("lichen.train").name == "lichen.train"
    get_logger("again")  # configuring twice must not add a second handler
    handlers = logging.getLogger("lichen").handlers
    assert len([h for h in handlers if type(h).__name__ == "_TqdmStderrHandler"]) == 1
    log.info("hello %d", 3)
    log.warning("careful")
    log.debug("hidden")
    err = capsys.readouterr().err
    assert err.splitlines() == ["[lichen] hello 3", "[lichen] WARNING: careful"]


def test_progress_and_print_line(capsys):
    seen = list(progress(range(5), desc="gen"))
    assert seen == [0, 1, 2, 3, 4]
    captured = capsys.readouterr()
    assert "gen" in captured.err and "5/5" in captured.err

    with progress(total=4, desc="train") as bar:
        bar.update(3)
        print_line("step 1 | reward 0.5")
        assert bar.n == 3
    captured = capsys.readouterr()
    assert captured.out == "step 1 | reward 0.5\n"
    assert "train" in captured.err

    assert list(progress([1, 2], disable=True)) == [1, 2]
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------------------------- secrets in sinks and logs


def test_wandb_key_goes_to_settings_and_config_is_redacted(tmp_path, monkeypatch):
    fake = _fake_wandb()
    fake.Settings = lambda **kw: ("settings", kw)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    config = {"lr": 1e-6, "wandb_key": "k-wandb-0001", "train_env_vars": {"HF_TOKEN": "t-0002"}, "_engine_key": "x"}
    with MetricsLogger(str(tmp_path), use_wandb=True, wandb_key="k-wandb-0001", config=config):
        pass
    (run,) = fake.runs
    assert run.init_kwargs["settings"] == ("settings", {"api_key": "k-wandb-0001"})
    assert run.init_kwargs["config"] == {
        "lr": 1e-6,
        "wandb_key": "<redacted>",
        "train_env_vars": {"HF_TOKEN": "<redacted>"},
    }


def test_log_lines_are_redacted(capsys):
    from lichen.observe.secrets import add_secrets, forget_secrets

    add_secrets(["planted-log-secret-42"])
    try:
        get_logger("secrets").warning("the server said: bad key planted-log-secret-42")
    finally:
        forget_secrets()
    assert capsys.readouterr().err == "[lichen] WARNING: the server said: bad key <redacted>\n"


# ------------------------------------------------------------------------------ --max-consecutive-failed-steps


def _step(*statuses, cause="KeyError: 'answer'"):
    from lichen.types import Sample, Status

    samples = [Sample(prompt="p", index=i, status=Status(s), metadata={}) for i, s in enumerate(statuses)]
    for s in samples:
        if s.status == Status.FAILED:
            s.metadata["reward_error"] = cause
    return [samples]


def test_failed_step_guard_counts_consecutive_all_failed_steps():
    from lichen.errors import RunError
    from lichen.observe.failed_steps import AllSamplesFailed, FailedStepGuard

    guard = FailedStepGuard(2)
    guard.check(0, _step("failed", "failed"))
    guard.check(1, _step("failed", "completed"))  # one sample scored: the streak starts over
    guard.check(2, _step("failed", "failed"))
    with pytest.raises(AllSamplesFailed) as info:
        guard.check(3, _step("failed", "failed"))
    assert isinstance(info.value, RunError)
    assert str(info.value).startswith(
        "every sample failed in 2 consecutive rollout step(s) (steps 3-4; 2 samples "
        "in the last, e.g. sample 0: KeyError: 'answer')"
    )
    assert "--max-consecutive-failed-steps" in str(info.value)


def test_failed_step_guard_zero_never_stops():
    from lichen.observe.failed_steps import FailedStepGuard

    guard = FailedStepGuard(0)
    for step in range(10):
        guard.check(step, _step("failed"))
    FailedStepGuard(1).check(0, [])  # a step without samples is not a failed one
