"""--runtime ray across two Ray nodes simulated on this host (ray.cluster_utils.Cluster: two raylets, one IP, one
filesystem): colocated, one trainer rank and one engine per node; weight sync with both transports, the disk one
after every engine read the sync directory's probe file."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'lichen[ray]')")

from helpers.ray_local import own_ray  # noqa: E402
from helpers.runs import base_args, run  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = pytest.mark.e2e  # see the marker in pyproject.toml: make test leaves it to make test-e2e


@pytest.fixture(scope="module")
def two_nodes():
    own_ray()
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 1, "object_store_memory": 100 * 1024 * 1024}
    )
    cluster.add_node(num_cpus=2, num_gpus=1, object_store_memory=100 * 1024 * 1024)
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize(
    "transport",
    [["--update-weight-transport", "nccl"], ["--update-weight-transport", "disk", "--update-weight-mode", "full"]],
)
def test_colocated_across_two_nodes(two_nodes, tiny_ckpt, addition_data, tmp_path, capfd, transport):
    disk = ["--update-weight-disk-dir", str(tmp_path / "versions")] if "disk" in transport else []
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
            "--actor-num-nodes",
            "2",
            "--actor-num-gpus-per-node",
            "1",
            "--rollout-num-gpus",
            "2",
            *transport,
            *disk,
        )
    )
    steps = [m for m in metrics if "train/loss" in m]
    assert [m["sync/weight_version"] for m in steps] == [1, 2]
    assert all(m["train/train_rollout_logprob_abs_diff"] <= 1e-5 for m in steps)
    # one rank on each node (the log line lists each rank's Ray node id)
    err = capfd.readouterr().err
    line = next(x for x in err.splitlines() if "rank(s), on Ray nodes" in x)
    rank_nodes = line.split("on Ray nodes ")[1].split(",")[0].split()
    assert len(rank_nodes) == 2 and len(set(rank_nodes)) == 2
    if disk:  # each engine's actor read the driver's probe file back from its own node (lichen.sync.visibility)
        assert f"--update-weight-disk-dir {disk[1]}: visible to all 2 engines" in err
