"""Where each trainer rank and each engine runs: a pure function from the layout flags to bundle indices.

The Ray runtime reserves ONE placement group of `{"GPU": 1, "CPU": 1}` bundles (as slime does) and gives each
trainer rank one bundle and each engine `--rollout-num-gpus-per-engine` consecutive bundles. The rules, as slime
lays them out (slime/ray/placement_group.py, re-derived here; tests/test_placement.py holds the table):

| run | bundles | trainer ranks on | engines on |
|---|---|---|---|
| disaggregated (default) | actor + rollout GPUs | 0 .. A-1 | A .. A+R-1 |
| `--colocate` | max(A, R) | 0 .. A-1 | 0 .. R-1 (the same bundles, taking turns) |
| `--debug-rollout-only` | R | none | 0 .. R-1 |
| `--debug-train-only` | A | 0 .. A-1 | none |
| external engines | A | 0 .. A-1 | none (already running) |

with A = --actor-num-nodes x --actor-num-gpus-per-node and R = --rollout-num-gpus. These indices are logical:
`bundle_order` maps them to the placement group's bundles sorted by (node, GPU id), so that ranks 0..G-1 share a
node and consecutive engines' GPUs are neighbours, whatever order Ray numbered the bundles in. Nodes are keyed by
their IP and then their Ray node id: two raylets on one host share an IP, so the IP alone does not tell them apart.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """The placement flags, resolved (lichen.config.cluster_config.ClusterConfig carries them)."""

    actor_num_nodes: int = 1
    actor_num_gpus_per_node: int = 1
    rollout_num_gpus: int = 1
    rollout_num_gpus_per_engine: int = 1
    colocate: bool = False
    debug_rollout_only: bool = False
    debug_train_only: bool = False
    external_engines: bool = False


@dataclass(frozen=True)
class Placement:
    """Logical bundle indices: `actor[r]` is rank r's bundle; `engines[i]` are engine i's bundles."""

    num_bundles: int
    actor: tuple[int, ...]
    engines: tuple[tuple[int, ...], ...]


def place(layout: Layout) -> Placement:
    """The bundles to reserve and which of them each trainer rank and each engine takes (see the module doc)."""
    num_actor = 0 if layout.debug_rollout_only else layout.actor_num_nodes * layout.actor_num_gpus_per_node
    has_engines = not (layout.debug_train_only or layout.external_engines)
    num_rollout = layout.rollout_num_gpus if has_engines else 0
    per_engine = layout.rollout_num_gpus_per_engine
    if num_rollout % per_engine:
        raise ValueError(
            f"rollout_num_gpus {num_rollout} is not a multiple of rollout_num_gpus_per_engine {per_engine}"
        )
    if layout.colocate:
        total, offset = max(num_actor, num_rollout), 0
    else:
        total, offset = num_actor + num_rollout, num_actor
    engines = tuple(
        tuple(range(offset + i * per_engine, offset + (i + 1) * per_engine)) for i in range(num_rollout // per_engine)
    )
    return Placement(num_bundles=total, actor=tuple(range(num_actor)), engines=engines)


@dataclass(frozen=True)
class BundleInfo:
    """What a probe actor on a bundle saw: the bundle's index in the group, its node and its GPU id."""

    index: int
    node_ip: str
    node_id: str
    gpu_id: int


def _ip_key(ip: str) -> tuple:
    try:
        return (0, tuple(int(p) for p in ip.split(".")))
    except ValueError:  # an IPv6 address or a host name: ordered as text, after the IPv4 ones
        return (1, tuple(ord(c) for c in ip))


def bundle_order(infos: list[BundleInfo]) -> list[BundleInfo]:
    """The bundles sorted by (node IP, node id, GPU id): logical index i -> `bundle_order(infos)[i]`."""
    return sorted(infos, key=lambda b: (_ip_key(b.node_ip), b.node_id, b.gpu_id))
