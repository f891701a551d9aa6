"""`--update-weight-transport tensor` with `--runtime ray --colocate`: the driver shares the weights that trainer
rank 0 gathered, and the engine servers that Ray actors started on this node map them. Before the first sync every
engine's actor reads back a probe file from this host's /dev/shm (lichen.sync.visibility.check_same_host)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install 'lichen[ray]')")

from helpers.runs import base_args, run  # noqa: E402


@pytest.mark.slow
def test_colocated_ray_run_syncs_by_tensor_handles(tiny_ckpt, addition_data, tmp_path, capfd):
    metrics = run(
        base_args(
            tiny_ckpt,
            addition_data,
            tmp_path / "out",
            "--num-rollout",
            "2",
            "--device",
            "cpu",
            "--num-threads",
            "1",
            "--runtime",
            "ray",
            "--colocate",
            "--actor-num-gpus-per-node",
            "2",
            "--rollout-num-gpus",
            "2",
            "--update-weight-transport",
            "tensor",
        )
    )
    steps = [m for m in metrics if "train/loss" in m]
    assert [m["sync/weight_version"] for m in steps] == [1, 2]
    assert all(m["sync/transport_tensor"] == 1 and m["sync/verified_tensors"] == 2 * 20 for m in steps)
    assert all(m["train/train_rollout_logprob_abs_diff"] <= 1e-5 for m in steps)
    err = capfd.readouterr().err
    assert "--update-weight-transport tensor /dev/shm: visible to all 2 engines" in err
