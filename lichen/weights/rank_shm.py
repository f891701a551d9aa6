"""A bucket every trainer rank on one host writes into at once: the `nccl` and `tensor` senders' path for CPU ranks
that map rank 0's shared memory (lichen.weights.rank_send.RankSender).

Rank 0 allocates the bucket in /dev/shm and hands every other rank its own handle (one reference each); every rank
maps it and writes its own rows of each tensor into it (`write_rows`: lichen.train.fsdp.write_local_rows), so no
shard crosses a process boundary; after a barrier each rank checksums a share of the tensors. What is in memory:
the bucket once, in /dev/shm (rank 0 holds it; the other ranks map it while they write), nothing else.

`host_shared` says once per sender whether this applies: rank 0 shares 16 random bytes, every rank maps them and
says whether it read the same (ranks on another host, or with another /dev/shm, do not).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from lichen.errors import ConfigError
from lichen.weights.rank_owners import all_gather_small
from lichen.weights.shm_buckets import open_bucket, serialize
from lichen.weights.wire import tensor_checksum

WriteRows = Callable[[list[str], list[torch.Tensor]], None]


def _share_with_ranks(flat: torch.Tensor, world: int) -> list[str]:
    """One handle of `flat` per other rank (each its own reference, released by that rank's mapping)."""
    return [serialize([("bucket", flat)]) for _ in range(world - 1)]


def host_shared(rank: int) -> bool:
    """Every rank at once: whether every rank maps rank 0's shared memory (one host, one /dev/shm)."""
    world = dist.get_world_size()
    box: list[Any] = [None]
    if rank == 0:
        token = list(os.urandom(16))
        probe = torch.tensor(token, dtype=torch.uint8)
        probe.untyped_storage()._share_filename_cpu_()
        box = [(token, _share_with_ranks(probe, world))]
    dist.broadcast_object_list(box, src=0)
    ok = True
    if rank != 0:
        try:
            ok = open_bucket(box[0][1][rank - 1]).tolist() == box[0][0]
        except Exception:  # another host or another /dev/shm: the file is not there
            ok = False
    return all(p["ok"] for p in all_gather_small({"ok": ok}))


@dataclass
class SharedFill:
    """A written bucket: on rank 0 the bucket and its views (in `names` order), elsewhere None and []; every
    rank's checksums merged on rank 0 ({} elsewhere); the slowest rank's write time."""

    flat: torch.Tensor | None
    views: list[torch.Tensor]
    sums: dict[str, str]
    fill_s: float


def fill_shared(
    rank: int,
    names: list[str],
    alloc: Callable[[], torch.Tensor | None],
    views_of: Callable[[torch.Tensor], list[torch.Tensor]],
    write_rows: WriteRows,
    after_map: Callable[[], None] | None = None,
) -> SharedFill | None:
    """Every rank at once: rank 0 allocates the bucket (`alloc()`: a uint8 tensor in shared memory; None when
    /dev/shm cannot hold it, then every rank returns None; a ConfigError, then every rank raises it), every rank
    maps it (`after_map` runs on the others once they have), writes its rows of the tensors `names` into
    `views_of(bucket)` and checksums a share of them."""
    world = dist.get_world_size()
    box: list[Any] = [None]
    flat: torch.Tensor | None = None
    if rank == 0:
        try:
            flat = alloc()
            box = [None if flat is None else _share_with_ranks(flat, world)]
        except ConfigError as e:  # every rank raises it, none waits for the bucket
            box = [str(e)]
    dist.broadcast_object_list(box, src=0)
    if box[0] is None:
        return None
    if isinstance(box[0], str):
        raise ConfigError(box[0])
    if rank != 0:
        flat = open_bucket(box[0][rank - 1])
        if after_map is not None:
            after_map()
    assert flat is not None
    views = views_of(flat)
    t0 = time.perf_counter()
    write_rows(names, views)
    fill_s = time.perf_counter() - t0
    dist.barrier()  # every rank's rows are in the bucket
    mine = {n: tensor_checksum(v) for i, (n, v) in enumerate(zip(names, views)) if i % world == rank}
    parts = all_gather_small({"sums": mine, "fill_s": fill_s})
    slowest = max(p["fill_s"] for p in parts)
    if rank != 0:
        return SharedFill(None, [], {}, slowest)  # this rank's mapping goes with its views
    sums = {n: s for p in parts for n, s in p["sums"].items()}
    return SharedFill(flat, views, {n: sums[n] for n in names}, slowest)
