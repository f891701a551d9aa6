"""--runtime ray: the node of an engine is lost mid-rollout (issue 32, item 3's last gap).

Three Ray nodes simulated on this host (ray.cluster_utils.Cluster: one raylet each, one IP, one filesystem): a head
without GPUs and two workers with one (fake) GPU each, so the one trainer rank and the one `lichen serve` engine
(disaggregated) sit on different nodes. At step 1, once the engine holds a request, the rollout plug-in removes the
engine's node from the cluster (its raylet, workers and the server the engine's actor started all die) and adds a
fresh node with one GPU. Ray reschedules the placement group's lost bundle onto it; with --use-fault-tolerance the
health monitor restarts the engine (RayEngineSet.restart: its actor is gone, so a new one goes on the same bundle,
now on the new node), the engine catches up to the last synced version from disk (one engine: nothing else can
serve, so it re-joins at once) and the requests it held are re-sent to it. The run ends with every sample trained
once. Every wait is on a condition; timeouts are failure bounds only.
"""

from __future__ import annotations

import contextvars
import threading
import time

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'lichen[ray]')")

from helpers.ray_local import own_ray  # noqa: E402
from helpers.runs import base_args, read_dump, run  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

STORE = 100 * 1024 * 1024
SEEN: dict = {}  # what the rollout plug-in saw, per step and at the node loss
NODES: dict = {}  # the test's Cluster, for the plug-in (it runs in the driver: this process)


def _engine_node(engines) -> str:
    """The Ray node id of engine 0's actor (EngineHostImpl.where)."""
    return ray.get(engines.launcher.actors[0].where.remote(), timeout=120)["node_id"]


def _lose_node_when_busy(engines, rollout: threading.Thread, timeout: float = 300.0) -> None:
    """Once engine 0 holds a request, remove the node of its actor from the Cluster, then add a fresh node with one
    GPU (resources exist again). In the main thread: Ray's Node registers signal handlers, which only it may do."""
    cluster: Cluster = NODES["cluster"]
    lost_id = _engine_node(engines)
    lost = next(n for n in cluster.list_all_nodes() if n.node_id == lost_id)
    assert lost is not cluster.head_node, "the engine must sit on a worker node (the head has no GPU)"
    end = time.monotonic() + timeout
    while engines.clients[0].in_flight == 0 and rollout.is_alive() and time.monotonic() < end:
        time.sleep(0.001)
    SEEN["in_flight_at_loss"] = engines.clients[0].in_flight
    SEEN["lost_node"] = lost_id
    cluster.remove_node(lost)
    SEEN["new_node"] = cluster.add_node(num_cpus=1, num_gpus=1, object_store_memory=STORE).node_id


def node_losing_rollout(args, rollout_id, data_source, evaluation=False):
    """Step 1: lose the engine's node while it holds a request. Every step: versions, restarts, the engine's node."""
    from lichen.rollout.context import current
    from lichen.rollout.generate import generate_rollout

    engines = current().engine
    SEEN.setdefault("versions", []).append(engines.weight_versions())
    SEEN.setdefault("restarts", []).append(list(engines.monitor.restarts))
    SEEN.setdefault("nodes", []).append(_engine_node(engines))
    if rollout_id != 1 or evaluation:
        return generate_rollout(args, rollout_id, data_source, evaluation)
    out: dict = {}
    context = contextvars.copy_context()  # the rollout's context (lichen.rollout.context.current) goes along

    def generate() -> None:
        try:
            out["result"] = context.run(generate_rollout, args, rollout_id, data_source)
        except BaseException as e:  # re-raised in the driver's thread below
            out["error"] = e

    rollout = threading.Thread(target=generate)
    rollout.start()
    try:
        _lose_node_when_busy(engines, rollout)
    finally:
        rollout.join()
    if "error" in out:
        raise out["error"]
    return out["result"]


@pytest.fixture
def three_nodes():
    """A head with no GPU and two worker nodes with one GPU each (Ray numbers them; CPU torch ignores them)."""
    own_ray()
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0, "object_store_memory": STORE}
    )
    for _ in range(2):
        cluster.add_node(num_cpus=1, num_gpus=1, object_store_memory=STORE)
    ray.init(address=cluster.address, log_to_driver=False)
    NODES["cluster"] = cluster
    yield cluster
    NODES.clear()
    ray.shutdown()
    cluster.shutdown()


@pytest.mark.slow
def test_an_engine_whose_node_is_lost_is_restarted_on_a_new_node(three_nodes, tiny_ckpt, addition_data, tmp_path):
    SEEN.clear()
    dump = str(tmp_path / "r_{rollout_id}.pt")
    metrics = run(
        base_args(
            tiny_ckpt,
            addition_data,
            tmp_path / "out",
            "--num-rollout",
            "3",
            "--device",
            "cpu",
            "--num-threads",
            "1",
            "--runtime",
            "ray",
            "--actor-num-gpus-per-node",
            "1",
            "--rollout-num-gpus",
            "1",
            # a full version on disk: the restarted lone engine loads it and re-joins at once (a broadcast leaves
            # nothing to load, so it would wait for the sync after the rollout that waits for it)
            "--update-weight-transport",
            "disk",
            "--update-weight-mode",
            "full",
            "--update-weight-disk-dir",
            str(tmp_path / "versions"),
            "--use-fault-tolerance",
            "--rollout-health-check-interval",
            "0.5",
            "--rollout-health-check-timeout",
            "30",
            "--rollout-health-check-first-wait",
            "0",
            "--rollout-function-path",
            "test_ray_engine_node_loss.node_losing_rollout",
            "--save-debug-rollout-data",
            dump,
        )
    )
    print("seen by the rollout plug-in:", SEEN)
    steps = [m for m in metrics if "train/loss" in m]
    assert len(steps) == 3, metrics
    assert SEEN["in_flight_at_loss"] >= 1
    # restarted once, after the loss; its new actor runs on the node added, not on the one removed
    assert SEEN["restarts"] == [[0], [0], [1]], SEEN["restarts"]
    assert SEEN["nodes"][0] == SEEN["nodes"][1] == SEEN["lost_node"]
    assert SEEN["nodes"][2] == SEEN["new_node"] != SEEN["lost_node"], SEEN
    for k in range(3):  # every group whole, no sample lost or twice
        groups = read_dump(dump.format(rollout_id=k))["samples"]
        assert [len(g) for g in groups] == [4, 4, 4, 4]
        assert sorted(s["index"] for g in groups for s in g) == list(range(16))
    # the restarted engine took step 2's sync: it serves the version the trainer pushed
    assert SEEN["versions"] == [[None], ["1"], ["2"]] or SEEN["versions"][1:] == [["1"], ["2"]], SEEN["versions"]
