"""`lichen train` over one vLLM engine that lichen launches (`--rollout-engine-backend vllm`), weights synced by
the disk transport (vLLM reloads each version in place: lichen.engines.clients.vllm_client): three steps, every sample
tagged with the version it was generated with, and the rollout / trainer log-prob mismatch logged per step (small
and non-zero: vLLM's float32 CPU kernels against lichen's)."""

from __future__ import annotations

import gzip
import json

import pytest
from helpers.runs import base_args, run
from helpers.vllm import vllm_python, vllm_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def test_three_steps_over_a_launched_vllm_engine_with_disk_sync(addition_data, tmp_path):
    vllm_python()
    ckpt = vllm_tiny_model(str(tmp_path / "ckpt"))
    argv = base_args(
        ckpt,
        addition_data,
        tmp_path / "out",
        "--num-rollout",
        "3",
        "--rollout-engine-backend",
        "vllm",
        "--rollout-num-engines",
        "1",
        "--update-weight-transport",
        "disk",
        "--update-weight-disk-dir",
        str(tmp_path / "weights"),
        "--vllm-max-model-len",
        "512",
        "--vllm-optimization-level",
        "0",  # no torch.compile: a minute less to start on this CPU
    )
    rows = [r for r in run(argv) if "train/train_rollout_logprob_abs_diff" in r]
    assert len(rows) == 3
    # every sync verified tensor by tensor (lichen's receiver's checksums of what it loaded), versions 1, 2, 3
    assert [r["sync/weight_version"] for r in rows] == [1, 2, 3]
    assert all(r["sync/verified_tensors"] > 0 for r in rows)
    # every sample of step k was generated with version k - 1 (vLLM's per-token version spans)
    for step in (1, 2, 3):
        with gzip.open(tmp_path / "out" / "samples" / f"step_{step:06d}.jsonl.gz", "rt") as f:
            versions = {tuple(json.loads(line)["weight_versions"]) for line in f}
        assert versions == {(str(step - 1),)}, (step, versions)
    diffs = [r["train/train_rollout_logprob_abs_diff"] for r in rows]
    print("train_rollout_logprob_abs_diff per step:", diffs)
    # different kernels, same float32 weights: close but not bit-equal; a wrong convention (T, offset, stale
    # weights) gives tenths to whole nats
    assert all(0 < d < 1e-3 for d in diffs), diffs
