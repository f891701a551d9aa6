"""`--update-weight-transport tensor` with `--runtime ray --colocate`: the trainer ranks, on one host, write their
own rows of each bucket into rank 0's shared memory (lichen.weights.rank_send: nothing gathered) and the engine
servers that Ray actors started on this node map it; the driver posts the handles and receives no tensor (issue
27: the driver-side guard). Before the first
sync every engine's actor reads back a probe file from this host's /dev/shm
(lichen.sync.visibility.check_same_host)."""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'lichen[ray]')")

from helpers.runs import base_args, run  # noqa: E402
from helpers.sync_guard import assert_served_what_was_sent, record_checksums, record_ray_gets  # noqa: E402

pytestmark = pytest.mark.e2e  # see the marker in pyproject.toml: make test leaves it to make test-e2e

BUCKET = 16 * 1024  # the tiny model is many buckets


@pytest.mark.slow
def test_colocated_ray_run_syncs_by_tensor_handles(tiny_ckpt, addition_data, tmp_path, capfd, monkeypatch):
    served = record_checksums(monkeypatch)
    received = record_ray_gets(monkeypatch, ray)
    writers = record_handle_writers(monkeypatch)
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
            "--update-weight-buffer-size",
            str(BUCKET),
        )
    )
    monkeypatch.undo()
    assert received and not any(received), f"the driver received {max(received)} bytes of tensors"
    assert_served_what_was_sent(served, 3)  # versions 0-2, both engines: what the ranks' buckets held
    # every bucket: both engines map one trainer rank's memory (the bucket every rank wrote into), never the driver's
    assert writers and all(len(set(pids)) == 1 and os.getpid() not in pids for pids in writers), writers[:3]
    assert len({pids[0] for pids in writers}) == 1  # rank 0's, every bucket
    steps = [m for m in metrics if "train/loss" in m]
    assert [m["sync/weight_version"] for m in steps] == [1, 2]
    assert all(m["sync/transport_tensor"] == 1 and m["sync/verified_tensors"] == 2 * 20 for m in steps)
    assert all(m["train/train_rollout_logprob_abs_diff"] <= 1e-5 for m in steps)
    err = capfd.readouterr().err
    assert "--update-weight-transport tensor /dev/shm: visible to all 2 engines" in err


def record_handle_writers(monkeypatch) -> list[list[int]]:
    """Wrap TensorSync's request bodies in the driver: per bucket, the pid of the process whose shared memory each
    engine's entry maps (torch names the file /torch_<pid>_...)."""
    import base64
    import re

    from lichen.sync.tensor_handles import TensorSync

    seen: list[list[int]] = []
    real = TensorSync._bodies

    def recording(handles, version, tp_sizes):
        seen.append([int(re.search(rb"/torch_(\d+)_", base64.b64decode(h)).group(1)) for h in handles])
        return real(handles, version, tp_sizes)

    monkeypatch.setattr(TensorSync, "_bodies", staticmethod(recording))
    return seen
