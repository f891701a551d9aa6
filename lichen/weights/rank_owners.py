"""Which trainer rank owns which tensor when the ranks publish a version together, and their small exchanges.

`disk` delta (lichen.weights.rank_delta) and `disk` full (lichen.weights.rank_full) under `--runtime ray` split the
tensors among the ranks by size, each tensor gathered into its owner only; every rank computes the same partition
from the same metadata, so no rank has to be told it.
"""

from __future__ import annotations

from typing import Any, Iterable


def owner_partition(sizes: Iterable[tuple[str, int]], world_size: int) -> dict[str, int]:
    """{name: owning rank}: largest tensor first to the least loaded rank (ties: the earlier name, the lower
    rank). Deterministic in `sizes`' order, so every rank computes the same partition."""
    items = list(sizes)
    order = sorted(range(len(items)), key=lambda i: (-items[i][1], i))
    load = [0] * max(1, int(world_size))
    owner: dict[str, int] = {}
    for i in order:
        r = min(range(len(load)), key=lambda k: (load[k], k))
        owner[items[i][0]] = r
        load[r] += items[i][1]
    return owner


def world() -> tuple[bool, int]:
    """(whether this process is in a torch.distributed group, its size): the trainer ranks' group under
    `--runtime ray`, else one process."""
    import torch.distributed as dist

    on = dist.is_available() and dist.is_initialized()
    return on, (dist.get_world_size() if on else 1)


def all_gather_small(obj: dict[str, Any], group: Any = None) -> list[dict[str, Any]]:
    """Every rank's `obj` (a small picklable dict), in rank order (this process's alone outside a process group).
    `group`: a process group of the same ranks other than the default one (a background thread's own)."""
    on, size = world()
    if not on or size == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out
