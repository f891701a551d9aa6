"""--async-save on the multi-rank trainer (issue 32 item 4): each rank stages its shards with DCP's async_save and
writes them (rank 0 also hf/) in the background while the next step trains; the files are a synchronous save's,
byte for byte, and a checkpoint committed from the ranks' entries verifies and resumes."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers.dist_ranks import (
    _trainer,
    _vocab,
    async_commit,
    async_save_begin,
    free_port,
    run_ranks,
    save,
    step_batch,
    trainer_argv,
)

from lichen.train import checkpoint
from lichen.train.ckpt_integrity import MANIFEST, verify


def async_worker(rank: int, world_size: int, argv: list[str], port: int, out: str) -> None:
    torch.set_num_threads(1)
    t = _trainer(argv, rank, world_size, port)
    sync_dir, async_dir = os.path.join(out, "sync"), os.path.join(out, "async")
    for step in range(2):
        t.train(step, step_batch(_vocab(t), step))
        save(t, sync_dir, step)
        async_save_begin(t, async_dir, step)
        t.train(step + 10, step_batch(_vocab(t), step + 10))  # changes the weights in place during the write
        async_commit(t, async_dir, step)
        dist.barrier()
        # the next step starts from the saved state again, so both saves of the next step see the same weights
        if rank == 0:
            verify(checkpoint.iter_dir(async_dir, step))
        t.load(async_dir, step)
    t.close()


def _files(d: str) -> dict[str, bytes]:
    out = {}
    for root, _, names in os.walk(d):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                out[os.path.relpath(os.path.join(root, name), d)] = f.read()
    return out


def _metadata(d: str):
    m = dcp.FileSystemReader(os.path.join(d, "dist")).read_metadata()
    return m.state_dict_metadata, m.storage_data


@pytest.mark.slow
def test_two_ranks_async_save_writes_the_sync_saves_bytes_and_resumes(tiny_ckpt, addition_data, tmp_path):
    """Every file byte-identical but DCP's .metadata, which records the checkpoint's own path and save id: its
    tensors' metadata and storage layout are equal (and checksums.json differs by that entry only)."""
    argv = trainer_argv(tiny_ckpt, addition_data, str(tmp_path / "o"))
    run_ranks(async_worker, 2, argv, free_port(), str(tmp_path))
    for step in range(2):
        da, db = checkpoint.iter_dir(str(tmp_path / "sync"), step), checkpoint.iter_dir(str(tmp_path / "async"), step)
        a, b = _files(da), _files(db)
        assert sorted(a) == sorted(b) and any(rel.startswith("dist/__") for rel in a)
        differ = [rel for rel in a if a[rel] != b[rel]]
        assert set(differ) <= {"dist/.metadata", MANIFEST}, (step, differ)
        assert _metadata(da) == _metadata(db)
        ma, mb = (json.loads(x[MANIFEST])["files"] for x in (a, b))
        assert {k: v for k, v in ma.items() if k != "dist/.metadata"} == {
            k: v for k, v in mb.items() if k != "dist/.metadata"
        }
    assert checkpoint.find_latest(str(tmp_path / "async")) == 1


@pytest.mark.slow
@pytest.mark.e2e
def test_ray_ranks_write_while_the_group_trains_and_the_driver_commits(tiny_ckpt, addition_data, tmp_path):
    """--runtime ray: every rank's write is held (LICHEN_TEST_CKPT_HOLD_FILE) until the group's next train step
    has returned to the driver; the driver's checkpoint thread waits for the writes in the ranks' "ckpt"
    concurrency group meanwhile (in the group of the training calls it would hold the step back: the hold would
    time out and the write fail). The committed checkpoint equals the synchronous save's and verifies."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'lichen[ray]')")
    from helpers.dist_ranks import config
    from helpers.ray_local import shared_ray

    from lichen.cluster.actor_group import RayTrainGroup
    from lichen.cluster.runtime import RayCluster
    from lichen.config.cluster_config import ClusterConfig
    from lichen.train import ckpt_async
    from lichen.train.rank_ckpt_async import HOLD_ENV

    shared_ray()
    assert ray.is_initialized()
    hold = str(tmp_path / "trained")
    cfg, args = config(trainer_argv(tiny_ckpt, addition_data, str(tmp_path / "o"), "--num-threads", "1"))
    cluster = RayCluster(
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
            train_env_vars={HOLD_ENV: hold},
        )
    )
    sync_dir, async_dir = str(tmp_path / "sync"), str(tmp_path / "async")
    try:
        group = RayTrainGroup(cluster, cfg, args)
        with open(os.path.join(tiny_ckpt, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        group.train(0, step_batch(vocab, 0))
        checkpoint.save_checkpoint(sync_dir, 0, group, {"n": 0})
        checkpoint.save_checkpoint(async_dir, 0, group, {"n": 0}, asynchronous=True)
        group.train(1, step_batch(vocab, 1))  # returns while every rank's write is held
        assert not os.path.exists(os.path.join(async_dir, checkpoint.LATEST))
        open(hold, "w").close()
        ckpt_async.wait_for_saves()
        da, db = checkpoint.iter_dir(sync_dir, 0), checkpoint.iter_dir(async_dir, 0)
        a, b = _files(da), _files(db)
        assert sorted(a) == sorted(b)
        assert set(rel for rel in a if a[rel] != b[rel]) <= {"dist/.metadata", MANIFEST}
        assert _metadata(da) == _metadata(db)
        assert checkpoint.find_latest(async_dir) == 0
        group.close()
    finally:
        ckpt_async.wait_for_saves(raise_errors=False)
        cluster.close()
