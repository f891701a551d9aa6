"""Weight sync from the trainer ranks under --runtime ray, disk full (issue 27 item 1): trainer rank 0 writes each
version one bucket per safetensors file, the driver receives no tensor larger than a bucket, every engine serves
exactly the checksums rank 0 wrote. (The broadcast transport's guard is in tests/test_ray_runtime.py.)"""

from __future__ import annotations

import json
import os

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'lichen[ray]')")

from helpers.ray_local import shared_ray  # noqa: E402
from helpers.runs import base_args, run  # noqa: E402
from helpers.sync_guard import assert_served_what_was_sent, record_checksums, record_ray_gets  # noqa: E402

BUCKET = 16 * 1024


@pytest.fixture(scope="module")
def ray_local():
    shared_ray()
    yield


@pytest.mark.slow
def test_disk_full_written_by_rank_zero_bucket_by_bucket(ray_local, tiny_ckpt, addition_data, tmp_path, monkeypatch):
    served = record_checksums(monkeypatch)
    received = record_ray_gets(monkeypatch, ray)
    versions = tmp_path / "versions"
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
            "--actor-num-gpus-per-node",
            "2",
            "--rollout-num-gpus",
            "1",
            "--update-weight-transport",
            "disk",
            "--update-weight-disk-dir",
            str(versions),
            "--update-weight-buffer-size",
            str(BUCKET),
            "--update-weight-disk-keep-files",
        )
    )
    monkeypatch.undo()
    assert received and max(received) <= BUCKET, f"the driver received {max(received)} bytes of tensors at once"
    assert_served_what_was_sent(served, 3)
    steps = [m for m in metrics if "train/loss" in m]
    assert [m["sync/weight_version"] for m in steps] == [1, 2]
    assert all(m["train/train_rollout_logprob_abs_diff"] <= 1e-5 for m in steps)
    v2 = versions / "weight_v000002"
    index = json.loads((v2 / "model.safetensors.index.json").read_text())
    files = sorted(f for f in os.listdir(v2) if f.endswith(".safetensors"))
    assert len(files) > 5 and sorted(set(index["weight_map"].values())) == files
    assert index["metadata"]["weight_version"] == "2"
    assert all(
        os.path.getsize(v2 / f) <= BUCKET + 4096
        for f in files
        if len([n for n, g in index["weight_map"].items() if g == f]) > 1
    )  # a multi-tensor file is one bucket
