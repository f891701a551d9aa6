"""Joining or starting Ray and reserving the run's placement group (lichen.cluster.placement says what goes where).

- `--ray-address` / `$RAY_ADDRESS` (also what `ray job submit` sets): join that cluster;
- otherwise start a new local Ray instance sized for the run (also where `ray start` runs a cluster on this host:
  joining one takes an address), listening on loopback only (`loopback_only`). On a host without CUDA it declares as many GPUs as the
  layout has bundles: Ray then places and numbers them (and sets CUDA_VISIBLE_DEVICES) as on a GPU node, and CPU
  torch ignores the variable, so the same placement code runs on a laptop.

The bundles are probed once (node IP, node id, GPU id) and ordered by `bundle_order`, so logical index i (rank i,
engine bundles) maps to a stable physical bundle.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
from typing import Any, Iterator

from lichen.cluster.placement import BundleInfo, Layout, Placement, bundle_order, place
from lichen.cluster.ray_reaper import start_reaper, stop_reaper
from lichen.config.cluster_config import ClusterConfig
from lichen.errors import ConfigError
from lichen.observe.metrics import get_logger

log = get_logger(__name__)

PLACEMENT_TIMEOUT_S = 120.0


def layout_of(cfg: ClusterConfig) -> Layout:
    return Layout(
        actor_num_nodes=cfg.actor_num_nodes,
        actor_num_gpus_per_node=cfg.actor_num_gpus_per_node,
        rollout_num_gpus=cfg.rollout_num_gpus,
        rollout_num_gpus_per_engine=cfg.rollout_num_gpus_per_engine,
        colocate=cfg.colocate,
        debug_rollout_only=cfg.debug_rollout_only,
        debug_train_only=cfg.debug_train_only,
        external_engines=cfg.external_engines or cfg.rollout_num_gpus == 0,
    )


def _probe_actor_cls():
    import ray

    @ray.remote(num_gpus=1, num_cpus=0)
    class _Probe:
        def where(self) -> tuple[str, str, int]:
            ctx = ray.get_runtime_context()
            return ray.util.get_node_ip_address(), ctx.get_node_id(), int(ray.get_gpu_ids()[0])

    return _Probe


class RayCluster:
    """The run's Ray connection and placement group. `close()` removes the group and stops a Ray lichen started."""

    def __init__(self, cfg: ClusterConfig, *, local_num_cpus: int | None = None):
        import ray

        self.cfg = cfg
        self.placement: Placement = place(layout_of(cfg))
        self.started_ray = False
        self._reaper: Any = None  # stops the Ray started here if this process dies (lichen.cluster.ray_reaper)
        if not ray.is_initialized():
            address = cfg.ray_address or os.environ.get("RAY_ADDRESS")
            if address:
                ray.init(address=address, log_to_driver=True)
            else:
                self._reaper = start_reaper()
                with loopback_only():
                    ray.init(**local_ray_options(self.placement.num_bundles, local_num_cpus))
                self.started_ray = True
                _check_loopback(ray.util.get_node_ip_address())
        self.driver_ip = ray.util.get_node_ip_address()
        self.pg, self.order = self._reserve()

    def _reserve(self) -> tuple[Any, list[BundleInfo]]:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        n = self.placement.num_bundles
        pg = placement_group([{"GPU": 1, "CPU": 1} for _ in range(n)], strategy="PACK")
        if not ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)[0]:
            have = ray.cluster_resources()
            remove_placement_group(pg)
            raise ConfigError(
                f"--runtime ray: the layout needs {n} bundles of 1 GPU + 1 CPU, the Ray cluster has "
                f"{have.get('GPU', 0):g} GPUs and {have.get('CPU', 0):g} CPUs; lower "
                "--actor-num-gpus-per-node / --rollout-num-gpus or add nodes"
            )
        probe = _probe_actor_cls()
        actors = [
            probe.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)
            ).remote()
            for i in range(n)
        ]
        seen = ray.get([a.where.remote() for a in actors])
        for a in actors:
            ray.kill(a)
        order = bundle_order([BundleInfo(i, ip, node, gpu) for i, (ip, node, gpu) in enumerate(seen)])
        for logical, b in enumerate(order):
            log.info(
                "bundle %d: group index %d, node %s (%s), GPU %d", logical, b.index, b.node_id[:8], b.node_ip, b.gpu_id
            )
        return pg, order

    def strategy(self, logical: int) -> Any:
        """The scheduling strategy that puts an actor on logical bundle `logical`."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            placement_group=self.pg, placement_group_bundle_index=self.order[logical].index
        )

    def gpu_ids(self, logicals: tuple[int, ...]) -> list[int]:
        return [self.order[i].gpu_id for i in logicals]

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            stop_reaper(self._reaper)
            return
        try:
            remove_placement_group(self.pg)
        except Exception as e:  # the cluster may already be gone
            log.warning("removing the placement group: %s", e)
        if self.started_ray:
            ray.shutdown()
            stop_reaper(self._reaper)


# Ray's switch for its local-only mode (the default on macOS and Windows): the node's address is the loopback one,
# and a node whose address is 127.0.0.1 has its GCS, raylet, workers, agents and metrics listen on loopback only
# (measured with ray 2.60: every socket of the instance on 127.0.0.1 instead of ::/0.0.0.0). Ray reads the variable
# when it is imported, so the driver's copy of the constant is switched too; the processes ray.init starts inherit
# the variable.
_LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def loopback_only() -> Iterator[None]:
    """Around the ray.init of a Ray instance lichen starts for this host: every Ray process listens on loopback."""
    from ray._private import ray_constants

    saved_env, saved_const = os.environ.get(_LOCAL_ONLY_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_LOCAL_ONLY_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_const
        if saved_env is None:
            os.environ.pop(_LOCAL_ONLY_ENV, None)
        else:
            os.environ[_LOCAL_ONLY_ENV] = saved_env


def _check_loopback(node_ip: str) -> None:
    """Say so loudly if a Ray version ignored the switch: its ports are then open to the network."""
    if not ipaddress.ip_address(node_ip).is_loopback:
        log.warning(
            "the Ray instance lichen started has node address %s, not loopback: its GCS, raylet and worker ports "
            "listen beyond this host (this Ray version ignores %s=0); keep Ray's token authentication on "
            "(docs/runtimes.md#network-exposure)",
            node_ip,
            _LOCAL_ONLY_ENV,
        )


def local_ray_options(num_bundles: int, num_cpus: int | None = None) -> dict:
    """ray.init options for a Ray instance lichen starts on this host: every bundle's CPU declared (the count is
    Ray's bookkeeping; the engines and ranks share the real cores), fake GPUs where there is no CUDA, no dashboard,
    a small object store. address="local": a new instance even where `ray start` left a cluster on this host
    (ray.init() without an address would join that one, and refuse these options there)."""
    import torch

    opts: dict = {
        "address": "local",
        "num_cpus": max(num_bundles, num_cpus or os.cpu_count() or 1),
        "include_dashboard": False,
        "object_store_memory": 256 * 1024 * 1024,
        "log_to_driver": True,
    }
    if not torch.cuda.is_available():
        opts["num_gpus"] = num_bundles  # Ray numbers them and sets CUDA_VISIBLE_DEVICES; CPU torch ignores it
    return opts
