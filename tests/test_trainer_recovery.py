"""lichen.cluster.trainer_recovery without Ray: which errors are recovered, how restarts are counted, where the
run goes back to (before the first checkpoint: step 0 and the initial rollout state), the metrics of the next
step. The real thing (Ray ranks SIGKILLed, the weights compared) is tests/test_ray_trainer_restart.py."""

from __future__ import annotations

import pytest

from lichen.cluster.actor_group import RankFailed
from lichen.cluster.trainer_recovery import TrainerRestarts, rank_failure
from lichen.errors import RunError


class Trainer:
    """A trainer whose restart can be made to fail with a rank's death `fail_restarts` times."""

    def __init__(self, fail_restarts: int = 0) -> None:
        self.restarts = 0
        self.fail_restarts = fail_restarts

    def restart(self) -> None:
        self.restarts += 1
        if self.restarts <= self.fail_restarts:
            raise RankFailed("trainer rank 0 failed in setup: its actor died (OOM.)", rank=0, method="setup")


def _restarts(n: int, tmp_path) -> TrainerRestarts:
    return TrainerRestarts(
        n, start=0, save_dir=str(tmp_path / "not_yet"), load_dir=None, initial_state={"epoch": 0, "offset": 0}
    )


def _death(rank: int = 1) -> RankFailed:
    return RankFailed(f"trainer rank {rank} failed in train: its actor died (x.)", rank=rank, method="train")


def test_a_rank_death_rewinds_to_step_0_before_the_first_checkpoint(tmp_path):
    restarts, trainer, calls = _restarts(2, tmp_path), Trainer(), []
    steps = restarts.steps(4)
    assert [next(steps), next(steps), next(steps)] == [0, 1, 2]
    restarts.recover(
        _death(), 2, trainer, lambda d, state: calls.append(("rewind", d, state)) or 0, lambda v: calls.append(v)
    )
    assert trainer.restarts == 1
    assert calls == [("rewind", None, {"epoch": 0, "offset": 0}), 0]  # the initial state, then version 0 pushed
    assert list(steps) == [0, 1, 2, 3]  # the driver goes on from step 0
    metrics = restarts.take_metrics()
    assert metrics["fault/trainer_restarts"] == 1 and metrics["fault/steps_replayed"] == 2
    assert restarts.take_metrics() == {}  # once, on the step after the recovery


def test_what_is_not_a_rank_death_is_raised_unchanged(tmp_path):
    restarts, trainer = _restarts(2, tmp_path), Trainer()
    error = RunError("engine http://127.0.0.1:1 answered 500")
    with pytest.raises(RunError) as e:
        restarts.recover(error, 0, trainer, lambda d, s: 0, lambda v: None)
    assert e.value is error and trainer.restarts == 0


def test_a_rank_death_under_another_error_is_found():
    death = _death()
    try:
        try:
            raise death
        except RankFailed as inner:
            raise RunError("weight sync to version 3 failed") from inner
    except RunError as outer:
        assert rank_failure(outer) is death


def test_without_restarts_the_rank_death_ends_the_run_as_it_was(tmp_path):
    death = _death()
    with pytest.raises(RankFailed) as e:
        _restarts(0, tmp_path).recover(death, 1, Trainer(), lambda d, s: 0, lambda v: None)
    assert e.value is death


def test_a_death_during_the_restart_uses_another_restart_and_then_they_are_used_up(tmp_path):
    restarts, trainer = _restarts(2, tmp_path), Trainer(fail_restarts=1)
    restarts.recover(_death(), 1, trainer, lambda d, s: 0, lambda v: None)
    assert trainer.restarts == 2 and restarts.restarts == 2
    with pytest.raises(RankFailed, match=r"^trainer rank 1 failed in train: .*; --max-trainer-restarts 2 used up$"):
        restarts.recover(_death(), 1, trainer, lambda d, s: 0, lambda v: None)
    assert trainer.restarts == 2  # nothing restarted once they are used up
