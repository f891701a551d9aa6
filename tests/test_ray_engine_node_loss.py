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
from helpers.runs import base_args, ray_args, read_dump, run  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = pytest.mark.e2e  # see the marker in pyproject.toml: make test leaves it to make test-e2e

STORE = 100 * 1024 * 1024
SEEN: dict = {}  # what the rollout plug-in saw, per step and at the node loss
NODES: dict = {}  # the test's Cluster, for the plug-in (it runs in the driver: this process)


def _engine_node(engine_set) -> str:
    """The Ray node id of engine 0's actor (EngineHostImpl.where) in `engine_set`, a RayEngineSet."""
    return ray.get(engine_set.actors[0].where.remote(), timeout=120)["node_id"]


def _lose_node_when_busy(engines, rollout: threading.Thread, timeout: float = 300.0) -> None:
    """Once engine 0 holds a request, remove the node of its actor from the Cluster, then add a fresh node with one
    GPU (resources exist again). In the main thread: Ray's Node registers signal handlers, which only it may do."""
    cluster: Cluster = NODES["cluster"]
    lost_id = _engine_node(engines.launcher)
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
    SEEN.setdefault("nodes", []).append(_engine_node(engines.launcher))
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
    SEEN["versions_after_loss"] = engines.weight_versions()  # the restarted engine caught up to version 1
    if "error" in out:
        raise out["error"]
    return out["result"]


@pytest.fixture
def three_nodes():
    """A head with no GPU and two worker nodes with one GPU each (Ray numbers them; CPU torch ignores them)."""
    own_ray()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0, "object_store_memory": STORE})
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
            *ray_args(1, 1),
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
            # a restart that fails retires the lone engine and stops the run at once, instead of its requests
            # waiting out the restart timeout (300 s)
            "--rollout-max-failed-restarts",
            "1",
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
    # the restarted engine loaded the last synced version to re-join, and took step 2's sync
    assert SEEN["versions"] == [["0"], ["1"], ["2"]], SEEN["versions"]
    assert SEEN["versions_after_loss"] == ["1"], SEEN


class _OneEngineOnBundle1:
    """What RayEngineSet reads of a RayCluster: one engine on bundle 1 of `pg` (bundle 0 holds the other GPU)."""

    def __init__(self, pg):
        from lichen.cluster.placement import Placement

        self.pg, self.driver_ip = pg, ray.util.get_node_ip_address()
        self.placement = Placement(num_bundles=2, actor=(0,), engines=((1,),))

    def strategy(self, logical: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=logical)

    def gpu_ids(self, logicals):
        return [0 for _ in logicals]


@pytest.mark.slow
def test_a_restart_waits_for_a_lost_node_up_to_the_ready_timeout_then_fails(three_nodes):
    """No node comes back: the restart gives up after its ready timeout with one clear error (the health monitor
    then counts a failed restart) and leaves no actor behind that could start a server later."""
    from ray.util.placement_group import placement_group

    from lichen.cluster.engine_actors import RayEngineSet

    pg = placement_group([{"GPU": 1, "CPU": 1}] * 2, strategy="PACK")  # one bundle on each worker: no GPU left
    ray.get(pg.ready(), timeout=120)
    engines = RayEngineSet(_OneEngineOnBundle1(pg), cfg=None)  # never started: its actor only has to exist
    lost_id = _engine_node(engines)
    three_nodes.remove_node(next(n for n in three_nodes.list_all_nodes() if n.node_id == lost_id))
    engines.ready_timeout = 5.0
    begin = time.monotonic()
    with pytest.raises(TimeoutError, match="engine 0: no new Ray actor on its placement-group bundle started within 5"):
        engines.restart(0)
    assert time.monotonic() - begin < 60
    with pytest.raises(ray.exceptions.RayActorError):  # the pending actor was killed, not left to start later
        ray.get(engines.actors[0].where.remote(), timeout=60)
