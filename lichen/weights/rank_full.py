"""A full version of the weights written by every trainer rank at once (`disk` full under `--runtime ray`).

With rank 0 writing every file, a full sync's write grows with the model and not with the ranks, and the whole
model passes through rank 0's link. Here the tensors are split among the ranks by size (lichen.weights.rank_owners:
each rank owns about model / ranks bytes); each tensor is gathered into its owner only (the FSDP2 shard exchange,
one all-to-all per 32 MiB of tensors: lichen.train.fsdp.owned_tensors) and the owner streams it into its current
file as it arrives (lichen.weights.safetensors_stream), so every rank writes the tensors the last exchange brought
it, at the same time as the others.

The files: each rank's owned tensors, in send order, cut into files of at most --update-weight-buffer-size bytes
(a larger tensor alone); the names number every rank's files together, rank 0's first
(`model-00001-of-NNNNN.safetensors`, ...). Every rank computes the same plan from the same metadata
(`plan_rank_files`). Each file's header carries the version's metadata, as a single writer's would; each rank
fsyncs its own files. The ranks then exchange their checksums and byte counts (small dicts) and rank 0 returns them with the weight map
(the plan); the driver writes the index, config.json and the tokenizer files and renames the directory into place
(lichen.sync.disk.FullDiskSync.push_from), so an engine loads it like any sharded HF checkpoint.

Memory per rank: the exchange's buffers and the tensor being written (a file is never held whole).

Errors: a rank that fails to write still takes part in every exchange, so every rank raises the same error and
none is left waiting in a collective.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from lichen.weights.hf_io import _fsync_file, _shard_name
from lichen.weights.rank_owners import all_gather_small, owner_partition
from lichen.weights.safetensors_stream import write_streamed
from lichen.weights.wire import parse_dtype, tensor_checksum


@dataclass(frozen=True)
class RankFile:
    """One safetensors file of the version: its name, the rank that writes it, its tensors in file order."""

    name: str
    rank: int
    tensors: tuple[str, ...]


def plan_rank_files(meta: list[list], dtype: torch.dtype, world_size: int, buffer_size: int) -> list[RankFile]:
    """The files of a version written by `world_size` ranks, from the tensor_meta rows `meta` (send order), in
    the engine dtype `dtype`: rank 0's files first. Deterministic: every rank computes the same list."""
    from lichen.weights.rank_send import engine_nbytes_of, plan_meta_buckets

    owner = owner_partition(((r[0], engine_nbytes_of(r[1], r[2], dtype)) for r in meta), world_size)
    per_rank = [
        [[row[0] for row in bucket] for bucket in plan_meta_buckets(rows, dtype, buffer_size)] if rows else []
        for rows in ([r for r in meta if owner[r[0]] == k] for k in range(max(1, world_size)))
    ]
    n = sum(len(files) for files in per_rank)
    names = (_shard_name(i, n) for i in range(n))
    return [RankFile(next(names), k, tuple(t)) for k, files in enumerate(per_rank) for t in files]


# where a rank does not see the directory the files go into, what to do about it
SYNC_DIR_HINT = (
    "the sync directory (--update-weight-disk-dir) must be shared by every trainer rank's node under the same path, "
    "or use --update-weight-transport nccl"
)


def sync_layout(meta: list[list], dtype: torch.dtype) -> dict[str, tuple[list[int], torch.dtype]]:
    """{name: (shape, dtype written)} of the tensor_meta rows `meta` sent in the engine dtype `dtype`."""
    from lichen.weights.rank_send import sent_dtype

    return {r[0]: (list(r[1]), parse_dtype(sent_dtype(r[2], dtype))) for r in meta}


def write_rank_files(
    rank: int,
    files: list[RankFile],
    owned: Iterator[tuple[str, torch.Tensor | None]],
    layout: dict[str, tuple[list[int], torch.dtype]],
    tmp_dir: str,
    header: dict[str, str],
    *,
    checksums: bool = True,
    missing_hint: str = SYNC_DIR_HINT,
    group: Any = None,
    error: str | None = None,
) -> dict[str, Any] | None:
    """Consume `owned` (every tensor's name, in send order on every rank, with its full tensor where this rank owns
    it, else None) and write this rank's files of `files` into `tmp_dir`, each tensor as `layout` gives it
    ({name: (shape, dtype)}), each file with the safetensors header metadata `header`. Rank 0 returns
    {"weight_map", "sums" (xxh3-128 of each tensor written, with `checksums`), "total_bytes", "ranks", "write_s"
    (the slowest rank's)}; other ranks None. Every rank raises the same error if any rank failed (`error`: one this
    rank had before it began, which it reports instead of writing); `missing_hint` says what to do when a rank does
    not see `tmp_dir`. The closing exchange runs on `group` (default: the trainer's group)."""
    t0 = time.perf_counter()
    sums: dict[str, str] = {}
    total = 0
    it = iter(owned)
    arriving = ((name, t) for name, t in it if t is not None)  # this rank's tensors, in send order

    def checked(n: int) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in itertools.islice(arriving, n):
            t = t.to("cpu")
            if checksums:
                sums[name] = tensor_checksum(t)
            yield name, t

    try:
        if error is None and not os.path.isdir(tmp_dir):  # made by rank 0 or the driver: not shared with this node
            raise FileNotFoundError(f"{tmp_dir} does not exist on this rank's node: {missing_hint}")
        for f in files if error is None else ():
            if f.rank != rank:
                continue
            path = os.path.join(tmp_dir, f.name)
            total += write_streamed(path, [(n, *layout[n]) for n in f.tensors], checked(len(f.tensors)), header)
            _fsync_file(path)
    except Exception as e:  # still takes part in every exchange below
        error = f"trainer rank {rank}: {type(e).__name__}: {e}"
    for _ in it:  # the exchanges of the tensors after this rank's last file (or after its error)
        pass
    out = {"error": error, "sums": sums, "total_bytes": total, "s": time.perf_counter() - t0}
    parts = all_gather_small(out, group)
    bad = [p["error"] for p in parts if p["error"]]
    if bad:
        raise RuntimeError("writing weight files: " + "; ".join(bad))
    if rank != 0:
        return None
    where = {n: f.name for f in files for n in f.tensors}  # the plan every rank followed
    return {
        "weight_map": {n: where[n] for n in layout},
        "sums": {k: v for p in parts for k, v in p["sums"].items()},
        "total_bytes": sum(p["total_bytes"] for p in parts),
        "ranks": len(parts),
        "write_s": max(p["s"] for p in parts),
    }
