"""A trainer rank that raises under --runtime ray (lichen.cluster.actor_group): the driver names the rank and
tears the group down at once, instead of the other ranks waiting in a collective for the process group's
timeout (600 s). The failure is a --custom-advantage-function-path plug-in that raises on rank 1 only, in the
step, after the first collectives (the old log-probs) and before the training micro-batches'."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'lichen[ray]')")

from helpers.dist_ranks import config, step_batch, trainer_argv  # noqa: E402
from helpers.ray_local import shared_ray  # noqa: E402

from lichen.cluster.actor_group import RankFailed, RayTrainGroup  # noqa: E402
from lichen.cluster.runtime import RayCluster  # noqa: E402
from lichen.config.cluster_config import ClusterConfig  # noqa: E402
from lichen.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.e2e  # see the marker in pyproject.toml: make test leaves it to make test-e2e


def raise_on_rank_1(args, samples, *, rewards, mask, kl):
    """An advantage plug-in that fails on trainer rank 1 and works on the others."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("injected failure on rank 1")
    return torch.full_like(mask, 0.25)


@pytest.fixture(scope="module")
def ray_local():
    shared_ray()
    yield


def _two_ranks() -> RayCluster:
    # the ranks import this module's plug-in: its directory goes on their path (as a user ships plug-ins)
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    return RayCluster(
        ClusterConfig(
            ray_address=None,
            actor_num_nodes=1,
            actor_num_gpus_per_node=2,
            rollout_num_gpus=0,
            rollout_num_gpus_per_engine=1,
            colocate=False,
            debug_rollout_only=False,
            debug_train_only=True,
            external_engines=False,
            device="cpu",
            train_env_vars={"PYTHONPATH": tests_dir},
        )
    )


@pytest.mark.slow
def test_a_rank_that_raises_in_its_step_stops_the_group_at_once(ray_local, tiny_ckpt, addition_data, tmp_path):
    cfg, args = config(
        trainer_argv(
            tiny_ckpt,
            addition_data,
            str(tmp_path / "o"),
            "--num-threads",
            "1",
            "--custom-advantage-function-path",
            "test_ray_rank_failure.raise_on_rank_1",
        )
    )
    with open(os.path.join(tiny_ckpt, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    cluster = _two_ranks()
    try:
        group = RayTrainGroup(cluster, cfg, args)
        with pytest.raises(RankFailed) as e:
            group.train(0, step_batch(vocab, 0))
        assert re.fullmatch(
            r"trainer rank 1 failed in train: RuntimeError: injected failure on rank 1; every rank was stopped "
            r"\(\d+\.\d s\)",
            str(e.value),
        ), str(e.value)
        assert (e.value.rank, e.value.method) == (1, "train")
        # Rank 0 was left waiting for rank 1 in the step's next collective: it is gone, not still waiting (it
        # would answer nothing before the 600 s process-group timeout).
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(group.actors[0].where.remote(), timeout=120)
        group.close()  # nothing left to close
    finally:
        cluster.close()


@pytest.mark.slow
def test_a_user_error_on_a_rank_stays_a_user_error(ray_local, tiny_ckpt, addition_data, tmp_path):
    """Loading a checkpoint directory that is not one: exit code 2 with the rank's one-line message."""
    cfg, args = config(trainer_argv(tiny_ckpt, addition_data, str(tmp_path / "o"), "--num-threads", "1"))
    cluster = _two_ranks()
    try:
        group = RayTrainGroup(cluster, cfg, args)
        with pytest.raises(ConfigError, match=r"^trainer rank \d: .*latest_checkpointed_iteration.txt: no readable"):
            group.load(str(tmp_path / "nothing"))
        group.close()
    finally:
        cluster.close()
