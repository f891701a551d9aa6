"""`--async` and `--fully-async` with `--runtime ray` (docs/async.md): the asynchronous drivers over Ray's trainer
ranks and engine actors. One run each, since a Ray run is slow on this machine."""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'lichen[ray]')")

from helpers.ray_local import shared_ray  # noqa: E402
from helpers.runs import base_args, dumped_samples, ray_args, run  # noqa: E402

pytestmark = pytest.mark.e2e  # see the marker in pyproject.toml: make test leaves it to make test-e2e


@pytest.fixture(scope="module")
def ray_local():
    for key in [k for k in os.environ if k.startswith("LICHEN_TEST_")]:  # see tests/test_ray_runtime.py
        del os.environ[key]
    shared_ray()
    yield


@pytest.mark.slow
def test_async_over_ray_two_ranks_one_engine(ray_local, tiny_ckpt, addition_data, tmp_path):
    dump = str(tmp_path / "d" / "r_{rollout_id}.pt")
    metrics = run(
        base_args(
            tiny_ckpt,
            addition_data,
            tmp_path / "o",
            "--num-rollout",
            "3",
            *ray_args(2, 1),
            "--async",
            "--save-debug-rollout-data",
            dump,
            "--save",
            str(tmp_path / "ckpt"),
        )
    )
    steps = [m for m in metrics if "train/loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert [m["train/staleness_max"] for m in steps] == [0, 1, 1]  # rollout k+1 made with version k
    assert [m["sync/weight_version"] for m in steps] == [1, 2, 3]
    for k in range(3):
        versions = {v for s in dumped_samples(dump.format(rollout_id=k)) for v in s["weight_versions"]}
        assert versions == {str(max(k - 1, 0))}
    with open(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt") as f:
        assert f.read().strip() == "2"


@pytest.mark.slow
def test_fully_async_over_ray(ray_local, tiny_ckpt, addition_data, tmp_path):
    dump = str(tmp_path / "d" / "r_{rollout_id}.pt")
    metrics = run(
        base_args(
            tiny_ckpt,
            addition_data,
            tmp_path / "o",
            "--num-rollout",
            "3",
            *ray_args(2, 1),
            "--fully-async",
            "--max-staleness",
            "1",
            "--save-debug-rollout-data",
            dump,
        )
    )
    steps = [m for m in metrics if "train/loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3] and all(m["train/staleness_max"] <= 1 for m in steps)
    for k in range(3):
        assert len(dumped_samples(dump.format(rollout_id=k))) == 16
