"""What `--runtime ray` listens on (issue 33): the Ray instance lichen starts for one host, and the trainer ranks'
process group (torch.distributed store and gloo), listen on loopback only. One Ray start, as the product starts
it (RayCluster without an address), with two trainer ranks whose trainer only joins the process group."""

from __future__ import annotations

import ipaddress
import os

import psutil
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'lichen[ray]')")

from helpers.ray_local import own_ray  # noqa: E402

from lichen.cluster.actor_group import RayTrainGroup  # noqa: E402
from lichen.cluster.runtime import RayCluster  # noqa: E402
from lichen.config.cluster_config import ClusterConfig  # noqa: E402

pytestmark = pytest.mark.e2e  # see the marker in pyproject.toml: make test leaves it to make test-e2e


def listening(proc: psutil.Process) -> list[tuple[str, int]]:
    """The (address, port) of every TCP/UDP socket `proc` listens on or has bound without a peer."""
    try:
        conns = proc.net_connections(kind="inet")
    except psutil.Error:  # exited meanwhile
        return []
    return [(c.laddr.ip, c.laddr.port) for c in conns if c.laddr and (c.status == psutil.CONN_LISTEN or not c.raddr)]


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


class ProcessGroupProbe:
    """A trainer class for the ranks: joins the process group as DistTrainer does, and reports its sockets."""

    def __init__(self, cfg, plugin_args, *, rank, world_size, master_addr, master_port, backend=None):
        import torch
        import torch.distributed as dist

        from lichen.train import fsdp

        fsdp.init_process_group(
            rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port, backend="gloo"
        )
        t = torch.ones(1)
        dist.all_reduce(t)  # gloo's pairs are connected (and listening) from here on
        self.sum = t.item()

    def sockets(self) -> dict:
        return {
            "pid": os.getpid(),
            "sum": self.sum,
            "sockets": listening(psutil.Process()),
            "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        }


@pytest.mark.slow
def test_ray_instance_and_process_group_listen_on_loopback_only():
    own_ray()  # this test starts Ray itself, as lichen train does
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    cluster = RayCluster(
        ClusterConfig(
            ray_address=None,
            actor_num_nodes=1,
            actor_num_gpus_per_node=2,
            rollout_num_gpus=0,
            rollout_num_gpus_per_engine=1,
            colocate=False,
            debug_rollout_only=False,
            debug_train_only=True,
            external_engines=False,
            device="cpu",
            train_env_vars={"PYTHONPATH": tests_dir},
        ),
        local_num_cpus=2,
    )
    try:
        assert cluster.started_ray
        group = RayTrainGroup(cluster, None, None, trainer_path="test_ray_sockets.ProcessGroupProbe")
        ranks = group._all("sockets")
        assert [r["sum"] for r in ranks] == [2.0, 2.0]
        assert all(r["gloo_ifname"] == "lo" for r in ranks)
        assert len(ranks[0]["sockets"]) > len(ranks[1]["sockets"])  # rank 0 also hosts the store
        # every process of the instance: the GCS, raylet, agents, dashboard head, workers (the ranks among them)
        # are this driver's descendants; the driver's own core worker listens too
        me = psutil.Process()
        procs = [me, *me.children(recursive=True)]
        assert {r["pid"] for r in ranks} <= {p.pid for p in procs}
        found = {p.pid: (p.name(), listening(p)) for p in procs}
        found.update({r["pid"]: ("rank", r["sockets"]) for r in ranks})
        assert sum(len(s) for _, s in found.values()) >= 6, found  # GCS, raylet, agents, workers, ranks, store
        wide = {pid: (name, [s for s in socks if not is_loopback(s[0])]) for pid, (name, socks) in found.items()}
        wide = {pid: v for pid, v in wide.items() if v[1]}
        assert wide == {}, f"sockets beyond loopback: {wide}"
        group.close()
    finally:
        cluster.close()
    assert not ray.is_initialized()
