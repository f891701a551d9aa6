"""An HF checkpoint export written by every trainer rank at once (a multi-rank checkpoint's hf/ and --save-hf).

The files are the single-process export's (lichen.weights.hf_io.plan_shards: tensors in state-dict order, a new
file at 5 GiB; the same names, tensors, headers and index), so a save on any number of ranks, synchronous or
--async-save, writes the same bytes. What changes is who writes them: each file goes to one rank (files split by
size, largest first to the least loaded rank: lichen.weights.rank_owners), each tensor is gathered into the rank
that writes its file and nowhere else, and each rank streams its tensors into its files as they arrive
(lichen.weights.rank_full.write_rank_files). No rank holds or receives the whole model: at 64 ranks a 355B model's
export (the trainer's float32 weights, 1.42 TB) is 265 files of 5 GiB, 4-5 per rank, written at the same time
instead of by rank 0 alone.

The tensors travel in an interleaved order (`send_order`: at each point the rank that has been sent the fewest
bytes gets its next tensor), so one exchange carries tensors for every rank and the ranks write at the same time.

Rank 0 makes the temporary directory beside the export (the other ranks learn its path in a small exchange),
writes the index, config.json and the tokenizer files once every rank's files are fsynced, and renames the
directory into place; every rank then learns whether that worked, so all ranks raise the same error or none.
Every rank must see the export's directory under the same path (as DCP's sharded checkpoint already requires).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from lichen.weights.hf_io import (
    INDEX_FILE,
    SINGLE_FILE,
    _fsync_dir,
    _fsync_file,
    _header_metadata,
    _shard_name,
    _swap_into_place,
    _write_json,
    write_side_files,
)
from lichen.weights.rank_full import RankFile, write_rank_files
from lichen.weights.rank_owners import all_gather_small, owner_partition

EXPORT_DIR_HINT = (
    "a multi-rank checkpoint's hf/ export and --save-hf are written by every trainer rank, so their directory must "
    "be shared by every rank's node under the same path (as --save's dist/ is)"
)


@dataclass(frozen=True)
class RankHfPlan:
    """Which rank writes which file of an export, the order the tensors travel in, and each tensor's layout."""

    files: tuple[RankFile, ...]
    order: tuple[str, ...]  # every tensor once: the send order every rank follows
    layout: dict[str, tuple[list[int], torch.dtype]]  # {name: (shape, dtype)}

    def owner(self) -> dict[str, int]:
        """{tensor name: the rank that writes its file}."""
        return {n: f.rank for f in self.files for n in f.tensors}


def layout_nbytes(shape: list[int], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * dtype.itemsize


def plan_rank_hf(
    shards: list[list[str]], layout: dict[str, tuple[list[int], torch.dtype]], world_size: int
) -> RankHfPlan:
    """The export of `shards` (hf_io.plan_shards' files, in order; {name: (shape, dtype)} in `layout`) written by
    `world_size` ranks. Deterministic: every rank computes the same plan."""
    names = [SINGLE_FILE] if len(shards) == 1 else [_shard_name(i, len(shards)) for i in range(len(shards))]
    sizes = [sum(layout_nbytes(*layout[n]) for n in names_) for names_ in shards]
    writer = owner_partition(zip(names, sizes), world_size)
    files = tuple(RankFile(name, writer[name], tuple(t)) for name, t in zip(names, shards))
    return RankHfPlan(files, send_order(files, layout, world_size), dict(layout))


def send_order(
    files: tuple[RankFile, ...], layout: dict[str, tuple[list[int], torch.dtype]], world_size: int
) -> tuple[str, ...]:
    """Every tensor of `files` once: each rank's tensors in its files' order, interleaved so that the next tensor
    is always the next one of the rank sent the fewest bytes so far (ties: the lower rank)."""
    queues: list[list[str]] = [[] for _ in range(max(1, world_size))]
    for f in files:
        queues[f.rank].extend(f.tensors)
    at = [0] * len(queues)
    sent = [0] * len(queues)
    out: list[str] = []
    while True:
        left = [r for r in range(len(queues)) if at[r] < len(queues[r])]
        if not left:
            return tuple(out)
        r = min(left, key=lambda k: (sent[k], k))
        name = queues[r][at[r]]
        at[r] += 1
        sent[r] += layout_nbytes(*layout[name])
        out.append(name)


def owned_only(
    rank: int, plan: RankHfPlan, tensors: Iterator[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """`tensors` (every rank given every tensor, e.g. LoRA's merged weights) with the ones this rank does not
    write replaced by None."""
    owner = plan.owner()
    for name, t in tensors:
        yield name, (t if owner[name] == rank else None)


def write_rank_hf(
    rank: int,
    out_dir: str,
    plan: RankHfPlan,
    owned: Iterator[tuple[str, torch.Tensor | None]],
    *,
    config: dict | None,
    copy_files_from: str | None,
    metadata: dict | None = None,
    group: Any = None,
    error: str | None = None,
) -> None:
    """Every rank: write this rank's files of `plan` from `owned` ((name, tensor where this rank writes it, else
    None) in `plan.order`), then rank 0 installs `out_dir` atomically (as hf_io.write_hf_shards: beside it, then
    renamed into place). `error`: a failure this rank had before (it still takes part in every exchange, and every
    rank raises it). The small exchanges run on `group` (default: the trainer's group)."""
    out_dir = os.path.abspath(out_dir)
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    made: dict[str, Any] = {"tmp": None, "error": None}
    if rank == 0:
        try:
            if os.path.exists(out_dir) and not os.path.isdir(out_dir):
                raise NotADirectoryError(f"checkpoint output {out_dir!r} exists and is not a directory")
            os.makedirs(os.path.dirname(out_dir), exist_ok=True)
            if os.path.exists(tmp):  # left by an earlier crash of a process with the same pid
                shutil.rmtree(tmp)
            os.makedirs(tmp)
            made["tmp"] = tmp
        except OSError as e:
            made["error"] = f"trainer rank 0: {type(e).__name__}: {e}"
    first = all_gather_small(made, group)[0]
    tmp = first["tmp"] or tmp
    try:
        part = write_rank_files(
            rank,
            list(plan.files),
            owned,
            plan.layout,
            tmp,
            _header_metadata(metadata),
            checksums=False,
            missing_hint=EXPORT_DIR_HINT,
            group=group,
            error=error or first["error"],
        )
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    installed: dict[str, Any] = {"error": None}
    if rank == 0:
        assert part is not None
        try:
            _finish_export(tmp, out_dir, plan, part, config, copy_files_from, metadata)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            installed["error"] = f"trainer rank 0: installing {out_dir}: {type(e).__name__}: {e}"
    bad = all_gather_small(installed, group)[0]["error"]
    if bad:
        raise RuntimeError(bad)


def _finish_export(
    tmp: str,
    out_dir: str,
    plan: RankHfPlan,
    part: dict[str, Any],
    config: dict | None,
    copy_files_from: str | None,
    metadata: dict | None,
) -> None:
    """Rank 0, once every rank's files are written and fsynced: the index (several files), config.json and the
    tokenizer files, then the directory renamed into place."""
    if len(plan.files) > 1:
        weight_map = {n: f.name for f in plan.files for n in f.tensors}  # in file order, as a single writer's
        index = {"metadata": {"total_size": part["total_bytes"], **(metadata or {})}, "weight_map": weight_map}
        _write_json(os.path.join(tmp, INDEX_FILE), index)
    write_side_files(tmp, config=config, copy_files_from=copy_files_from)
    written = {f.name for f in plan.files}
    for fname in os.listdir(tmp):
        if fname not in written:  # the ranks fsynced their own
            _fsync_file(os.path.join(tmp, fname))
    _fsync_dir(tmp)
    _swap_into_place(tmp, out_dir)
