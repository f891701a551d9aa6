"""Weight sync from the trainer ranks under --runtime ray (issue 27 item 1). disk full: each rank writes the tensors
it owns into its own files (about half the bytes each), the driver receives no tensor, every engine serves exactly
the checksums the ranks wrote. disk delta: each rank encodes the tensors it owns and writes its own file of
each version, the driver writes only the index; 2 ranks and 1 rank publish the same weights. (The broadcast
transport's guard is in tests/test_ray_runtime.py.)"""

from __future__ import annotations

import json
import os

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'lichen[ray]')")

from helpers.ray_local import shared_ray  # noqa: E402
from helpers.runs import base_args, run  # noqa: E402
from helpers.sync_guard import assert_served_what_was_sent, record_checksums, record_ray_gets  # noqa: E402

pytestmark = pytest.mark.e2e  # see the marker in pyproject.toml: make test leaves it to make test-e2e

BUCKET = 16 * 1024


@pytest.fixture(scope="module")
def ray_local():
    shared_ray()
    yield


def disk_run(ckpt, data, out, ranks: int, rollouts: int, versions, *extra: str) -> list[dict]:
    """A --runtime ray run on CPU: `ranks` trainer ranks, one engine, disk sync into `versions` (kept)."""
    ray_args = ("--runtime", "ray", "--actor-num-gpus-per-node", str(ranks), "--rollout-num-gpus", "1")
    disk = ("--update-weight-transport", "disk", "--update-weight-disk-dir", str(versions))
    cpu = ("--device", "cpu", "--num-threads", "1", "--num-rollout", str(rollouts))
    return run(base_args(ckpt, data, out, *cpu, *ray_args, *disk, "--update-weight-disk-keep-files", *extra))


@pytest.mark.slow
def test_disk_full_written_by_every_rank(ray_local, tiny_ckpt, addition_data, tmp_path, monkeypatch):
    import torch

    from lichen.models.config import ModelConfig
    from lichen.models.transformer import CausalLM
    from lichen.weights.hf_io import load_hf_state_dict
    from lichen.weights.rank_full import plan_rank_files
    from lichen.weights.rank_send import tensor_meta

    served = record_checksums(monkeypatch)
    received = record_ray_gets(monkeypatch, ray)
    versions = tmp_path / "versions"
    metrics = disk_run(
        tiny_ckpt, addition_data, tmp_path / "out", 2, 2, versions, "--update-weight-buffer-size", str(BUCKET)
    )
    monkeypatch.undo()
    assert not any(received), "the driver received tensors from the ranks"
    assert_served_what_was_sent(served, 3)
    steps = [m for m in metrics if "train/loss" in m]
    assert [m["sync/weight_version"] for m in steps] == [1, 2]
    assert all(m["sync/publish_ranks"] == 2 for m in steps)
    assert all(m["train/train_rollout_logprob_abs_diff"] <= 1e-5 for m in steps)
    v2 = versions / "weight_v000002"
    index = json.loads((v2 / "model.safetensors.index.json").read_text())
    files = sorted(f for f in os.listdir(v2) if f.endswith(".safetensors"))
    assert len(files) > 5 and sorted(set(index["weight_map"].values())) == files
    assert index["metadata"]["weight_version"] == "2"
    # the files are the two ranks' shares, each rank's cut at the bucket size, as every rank plans them (from the
    # tensors in send order: the model's parameter order)
    state = load_hf_state_dict(str(v2))
    with torch.device("meta"):
        order = [n for n, _ in CausalLM(ModelConfig.from_pretrained(tiny_ckpt)).named_parameters()]
    meta = [tensor_meta(n, state[n]) for n in order if n in state]
    assert len(meta) == len(state)
    dtype = next(iter(state.values())).dtype
    plan = plan_rank_files(meta, dtype, 2, BUCKET)
    assert {f.name: sorted(f.tensors) for f in plan} == {
        f: sorted(n for n, g in index["weight_map"].items() if g == f) for f in files
    }
    share = [sum(os.path.getsize(v2 / f.name) for f in plan if f.rank == r) for r in (0, 1)]
    assert min(share) > 0.4 * sum(share), share  # about half the bytes each


def delta_run(ckpt, data, tmp_path, ranks: int) -> tuple[list[dict], str]:
    versions = tmp_path / f"versions{ranks}"
    local = str(tmp_path / f"local{ranks}")
    extra = ("--update-weight-mode", "delta", "--update-weight-local-checkpoint-dir", local)
    return disk_run(ckpt, data, tmp_path / f"out{ranks}", ranks, 3, versions, *extra), str(versions)


def decoded(versions: str, version: int, base: str, where) -> dict:
    """Version `version` of the chain under `versions` as an engine builds it (checksums checked)."""
    from lichen.weights.hf_io import load_hf_state_dict
    from lichen.weights.pull import pull_weights

    pull_weights(str(where), versions, version, base_dir=base)
    return load_hf_state_dict(str(where))


@pytest.mark.slow
def test_disk_delta_encoded_by_the_owning_ranks(ray_local, tiny_ckpt, addition_data, tmp_path, monkeypatch):
    import torch

    served = record_checksums(monkeypatch)
    received = record_ray_gets(monkeypatch, ray)
    two, versions2 = delta_run(tiny_ckpt, addition_data, tmp_path, 2)
    monkeypatch.undo()
    assert not any(received), "the driver received tensors from the ranks"
    assert_served_what_was_sent(served, 4)  # versions 0-3: every engine serves what the ranks published
    steps = [m for m in two if "train/loss" in m]
    assert [m["sync/weight_version"] for m in steps] == [1, 2, 3]
    assert [m["sync/is_delta"] for m in steps] == [0, 1, 1] and all(m["sync/publish_ranks"] == 2 for m in steps)
    assert all(m["train/train_rollout_logprob_abs_diff"] <= 1e-5 for m in steps)
    for v in (1, 2, 3):  # each rank wrote the tensors it owns, in its own file; the index names them
        vdir = os.path.join(versions2, f"weight_v{v:06d}")
        index = json.loads(open(os.path.join(vdir, "model.safetensors.index.json")).read())
        assert ("delta_encoding" in index["metadata"]) == (v > 1)
        assert set(index["weight_map"].values()) == {
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
        }
    one, versions1 = delta_run(tiny_ckpt, addition_data, tmp_path, 1)
    assert [m["sync/publish_ranks"] for m in one if "train/loss" in m] == [1, 1, 1]
    for v in (1, 2, 3):  # the same weights, decoded as the engines decode them (training on 2 ranks sums in
        a = decoded(versions2, v, tiny_ckpt, tmp_path / f"d2_{v}")  # another order: equal within rounding)
        b = decoded(versions1, v, tiny_ckpt, tmp_path / f"d1_{v}")
        assert sorted(a) == sorted(b)
        for n in a:
            assert torch.allclose(a[n].float(), b[n].float(), rtol=0, atol=1e-5), (v, n)
