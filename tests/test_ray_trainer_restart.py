"""A trainer rank SIGKILLed mid-step under --runtime ray (issue 32 item 1): with --max-trainer-restarts the driver
restarts the ranks on the same bundles, rewinds to the newest checkpoint (or step 0 before the first one),
re-syncs the `lichen serve` engine and goes on; the run ends with the uninterrupted run's weights and trains every
step's samples. Without the flag the run ends with one line, exit code 1, and nothing of it left in Ray.

The kills are file triggers, not timers: rank 1's --custom-advantage-function-path plug-in, at its call n within
one process (after the step's first collectives), SIGKILLs itself if the file `call_<n>` exists in the trigger
directory, removing it first so that no later rank fires it again. The ranks import this module: the tests
directory goes on their PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'lichen[ray]')")

from helpers.ray_local import shared_ray  # noqa: E402
from helpers.runs import base_args, final_weights, ray_args, run  # noqa: E402

from lichen.cli import main  # noqa: E402
from lichen.cluster.actor_group import exit_cause  # noqa: E402
from lichen.observe.metrics import read_metrics  # noqa: E402
from lichen.observe.sample_log import read_samples  # noqa: E402

pytestmark = pytest.mark.e2e  # see the marker in pyproject.toml: make test leaves it to make test-e2e

TRIGGER_ENV = "LICHEN_TEST_KILL_TRIGGERS"
_calls = {"n": 0}  # this rank process' calls of the plug-in: one per step


def kill_rank_1(args, samples, *, rewards, mask, kl):
    """Advantages 0.25 on every token; on rank 1, at call n of this process, if `call_<n>` exists in the trigger
    directory: remove it and SIGKILL this process (the rank's Ray actor dies as with the OOM killer)."""
    import torch.distributed as dist

    call, _calls["n"] = _calls["n"], _calls["n"] + 1
    trigger = os.path.join(os.environ.get(TRIGGER_ENV, "/nonexistent"), f"call_{call}")
    if dist.get_rank() == 1 and os.path.exists(trigger):
        os.unlink(trigger)
        os.kill(os.getpid(), signal.SIGKILL)
    return torch.full_like(mask, 0.25)


def _arm(tmp_path, *calls: int) -> str:
    triggers = tmp_path / "triggers"
    triggers.mkdir()
    for n in calls:
        (triggers / f"call_{n}").write_text("armed")
    return str(triggers)


@pytest.fixture(scope="module")
def ray_local():
    shared_ray()
    yield


def _argv(tiny_ckpt, data, tmp_path, name: str, triggers: str, *extra: str, steps: int = 3) -> list[str]:
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    return base_args(
        tiny_ckpt,
        data,
        tmp_path / name,
        "--num-rollout",
        str(steps),
        *ray_args(2, 1),
        "--save",
        str(tmp_path / f"{name}_ckpt"),
        "--save-interval",
        "2",  # checkpoints after steps 2 and 3 (the last)
        # written before the step goes on: with --async-save the ranks may still be writing step 2's checkpoint
        # when the kill at step 3 comes, and then it is lost (the run goes back to step 0, correctly, but which
        # of the two happens would depend on timing)
        "--no-async-save",
        "--log-samples",
        "16",  # every sample of a step (4 prompts x 4)
        "--custom-advantage-function-path",
        "test_ray_trainer_restart.kill_rank_1",
        "--train-env-vars",
        json.dumps({"PYTHONPATH": tests_dir, TRIGGER_ENV: triggers}),
        *extra,
    )


def _steps_samples(out) -> dict[int, list[tuple[int, list[int]]]]:
    """{step: sorted (sample index, response tokens)} of the sample log: which samples each step trained on."""
    by_step: dict[int, list] = {}
    for r in read_samples(str(out)):
        by_step.setdefault(r["step"], []).append((r["index"], r["tokens"]))
    return {k: sorted(v) for k, v in by_step.items()}


@pytest.mark.slow
@pytest.mark.parametrize("driver", [[], ["--async"]], ids=["sync", "async"])
def test_rank_sigkilled_mid_step_recovers_to_the_uninterrupted_runs_weights(
    ray_local, tiny_ckpt, addition_data, tmp_path, driver
):
    """Two kills of rank 1 in one run: at step 2 (no checkpoint yet: back to step 0, step 1 replayed), then in its
    successor at step 3 (back to the checkpoint of step 2, nothing completed to replay). With --async the
    generation of the next step is in flight at each kill; the checkpoint holds the rollout made ahead."""
    straight = run(_argv(tiny_ckpt, addition_data, tmp_path, "a", str(tmp_path / "no_triggers"), *driver))
    triggers = _arm(tmp_path, 1, 2)  # process 1: call 1 = step 2; process 2: call 2 = step 3
    recovered = run(_argv(tiny_ckpt, addition_data, tmp_path, "b", triggers, "--max-trainer-restarts", "2", *driver))
    assert os.listdir(triggers) == []  # both kills happened

    wa, wb = final_weights(tmp_path / "a_ckpt"), final_weights(tmp_path / "b_ckpt")
    assert wa.keys() == wb.keys()
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= 1e-6

    steps = [m for m in recovered if "train/loss" in m]
    assert [m["step"] for m in steps] == [1, 1, 2, 3]
    faults = [(m["step"], m.get("fault/trainer_restarts"), m.get("fault/steps_replayed")) for m in steps]
    assert faults == [(1, None, None), (1, 1, 1), (2, None, None), (3, 2, 0)]
    assert all(m["time/trainer_recovery"] > 0 for m in steps if "fault/trainer_restarts" in m)
    assert not any(k.startswith("fault/") for m in straight for k in m)
    for a, b in zip([m for m in straight if "train/loss" in m], steps[1:]):
        assert a["sync/weight_version"] == b["sync/weight_version"]
        assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-6)

    # every step trained the same 16 samples as the uninterrupted run, each once (a replayed step's file is the
    # replay's): none lost, none twice
    sa, sb = _steps_samples(tmp_path / "a"), _steps_samples(tmp_path / "b")
    assert sorted(sa) == sorted(sb) == [1, 2, 3]
    for step in (1, 2, 3):
        assert [i for i, _ in sb[step]] == list(range(16))
        assert sb[step] == sa[step]


@pytest.mark.slow
def test_without_restarts_a_killed_rank_ends_the_run_with_one_line(
    ray_local, tiny_ckpt, addition_data, tmp_path, capsys
):
    triggers = _arm(tmp_path, 1)
    # Ray is shared by the session: an earlier test's actors may still be releasing their resources (Ray frees them
    # asynchronously), so the baseline is taken once everything is back (failed once in CI: 5 CPUs free before, 8
    # after)
    before = _settled(ray.cluster_resources())
    assert main(_argv(tiny_ckpt, addition_data, tmp_path, "c", triggers, steps=2)) == 1
    assert os.listdir(triggers) == []
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lichen train:")]
    assert len(err) == 1, err
    line = err[0]
    assert line.startswith("lichen train: error: trainer rank 1 failed in train: its actor died (")
    assert line.count("(") == line.count(")") and "; every rank was stopped (" in line
    assert not any("fault/" in k for m in read_metrics(str(tmp_path / "c")) for k in m)
    # nothing of the run is left in Ray: its placement group removed (Ray then kills the actors in it: ranks and
    # engine), and the resources back; Ray frees them asynchronously, hence the bounded poll
    groups = ray.util.placement_group_table().values()
    assert groups and all(g["state"] == "REMOVED" for g in groups), [g["state"] for g in groups]
    assert _gpu_cpu(_settled(before)) == _gpu_cpu(before)


def _gpu_cpu(resources: dict) -> tuple:
    return resources.get("GPU"), resources.get("CPU")


def _settled(total: dict, timeout: float = 120.0) -> dict:
    """Ray's available resources once their GPUs and CPUs equal `total`'s, or as they are after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _gpu_cpu(ray.available_resources()) != _gpu_cpu(total):
        time.sleep(0.5)
    return ray.available_resources()


def test_exit_cause_of_a_dead_actor_is_one_balanced_sentence(ray_local):
    """Ray's message for an actor killed mid-task runs over many lines; the summary keeps its first sentence."""

    @ray.remote(num_cpus=0)
    class Victim:
        def pid(self) -> int:
            return os.getpid()

        def die(self) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

    victim = Victim.remote()
    ray.get(victim.pid.remote(), timeout=120)
    with pytest.raises(ray.exceptions.RayActorError) as e:
        ray.get(victim.die.remote(), timeout=120)
    assert "\n" in str(e.value)  # what the old summary cut at its first newline
    cause = exit_cause(e.value)
    assert "\n" not in cause and cause.startswith("its actor died (") and cause.endswith(")")
    assert cause.count("(") == cause.count(")")


def test_exit_cause_of_an_exception_is_its_first_line():
    class Wrapped(Exception):
        cause = RuntimeError("boom\nsecond line")

    assert exit_cause(Wrapped("x")) == "RuntimeError: boom"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--max-trainer-restarts", "1"], "--max-trainer-restarts places Ray actors; add --runtime ray"),
        (["--runtime", "ray", "--rollout-num-gpus", "1", "--max-trainer-restarts", "-1"], "whole number >= 0"),
        (
            ["--runtime", "ray", "--rollout-num-gpus", "1", "--max-trainer-restarts", "2", "--fully-async"],
            "does not work with --fully-async yet",
        ),
    ],
)
def test_max_trainer_restarts_is_checked(tiny_ckpt, addition_data, tmp_path, capsys, argv, message):
    assert main(base_args(tiny_ckpt, addition_data, tmp_path, "--dry-run", "--num-rollout", "1", *argv)) == 2
    assert message in capsys.readouterr().err
