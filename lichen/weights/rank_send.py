"""The sending half of weight sync, run where the weights are (docs/architecture.md#weight-sync).

Under `--runtime ray` every trainer rank holds one `RankSender` (lichen.train.dist_trainer.DistTrainer.sync_weights);
with `--runtime local` the `lichen train` process holds one (lichen.sync.senders). The driver's half of a transport
(lichen.sync) makes the HTTP calls and tells the senders which bucket to send; no tensor passes through it.

A sender reads the weights one tensor at a time through `gather_owned(names, dtype, owner)`, which yields the full
tensor on the rank that owns it and None on the others: on an FSDP2 rank each DTensor's shard is cast to the
engine dtype and sent to the owner (one all-to-all per 32 MiB of tensors: lichen.train.fsdp.owned_tensors), a
collective: every rank must be asked for the same names in the same order, and every rank is (the driver calls an
op on all ranks at once). `nccl` and the sampled check gather into rank 0 only (`to_rank0`): it owns
the broadcast group's store and rank 0 of the group, and it returns the per-tensor checksums of what it sent, which
the driver compares with the engines' own (lichen.sync.verify). `disk` full and delta gather each tensor into the
rank that writes it (a partition by size: lichen.weights.rank_full, lichen.weights.rank_delta). Where a sender has no `gather_owned` (LoRA's merged weights, the single-process sender), `gather(names,
dtype)` gives every rank every full tensor (an all-gather) and the others drop theirs.

CPU ranks on one host (probed once: `_host_shared`) skip the gathers of `nccl` and `tensor`: rank 0 allocates the
bucket in shared memory and every rank writes its own rows of each tensor into it at the same time
(lichen.weights.rank_shm; `write_rows`: lichen.train.fsdp.write_local_rows), then checksums a share of the tensors; no shard crosses a process boundary.
A bucket larger than /dev/shm has free, or one whose packed offsets a dtype cannot start at, is gathered instead.

Memory: a bucket is gathered into one preallocated buffer of the bucket's size in the engine dtype, each tensor
built in its place there where the ranks exchange shards (else copied in and freed). The broadcast gathers the
next bucket while the current one is on the wire, so rank 0's extra memory during a sync is two such buffers plus
two exchanges' received shards (up to 2 x 32 MiB: the next exchange starts before the current one is unpacked)
and the largest single tensor; the other ranks hold two exchanges' padded shards (2 x 32 MiB / ranks) at most.

`tensor` (colocated engines), where every rank maps rank 0's shared memory (above): rank 0 answers one handle per
engine TP rank, all of the one bucket the ranks wrote. Otherwise (CUDA ranks, or ranks on several hosts) every
rank gathers the bucket; each rank that serves engine TP ranks (entry j of
the engines' TP ranks, in order, is served by trainer rank j mod world size: on GPUs, rank r shares its device
with entry r) writes it into its own shared-memory (or CUDA) bucket and serializes one handle per entry it
serves; the handles (a few hundred bytes each) are collected on rank 0, which answers them with the checksums.
The bucket stays held until the next bucket or `tensor_release` (the engines map it until they answered).

A leaf module: torch and lichen.weights only (the `tensor` op borrows lichen.sync.tensor_handles' serializer).
"""

from __future__ import annotations

import os
import signal
import socket
from typing import Any, Callable, Iterable, Iterator, Protocol
from urllib.parse import urlsplit

import torch

from lichen.weights.shm_buckets import BucketPool
from lichen.weights.wire import dtype_name, master_store, open_group, parse_dtype, tensor_checksum

# what the driver may ask of a rank's sender (DistTrainer.sync_weights)
SENDER_OPS = frozenset(
    {
        "meta",
        "group_store",
        "group_join",
        "group_close",
        "broadcast",
        "rows",
        "write_full",
        "delta_part",
        "tensor_bucket",
        "tensor_release",
    }
)

# gather(names, dtype): (name, full tensor) for each of `names`, in order. `dtype` is the engine dtype the caller
# casts floating-point tensors to: a gather may cast before it gathers (an FSDP2 rank casts its shard, so the
# all-gather moves engine-dtype bytes: half of fp32's for bf16 engines; the cast is elementwise, so the result is
# bitwise the same) or yield the tensors as they are.
Gather = Callable[[list[str], torch.dtype | None], Iterator[tuple[str, torch.Tensor]]]


# gather_owned(names, dtype, owner): (name, full tensor) on the rank owner[name], (name, None) on the others, in
# order: each tensor goes to its owner only (FSDP2 ranks exchange their shards in all-to-alls:
# lichen.train.fsdp.owned_tensors). Rank 0 owns every tensor for `nccl` and the sampled check; for `disk` full
# and delta each rank owns the tensors it writes. Without one, every rank gathers every tensor (an
# all-gather) and keeps its own.
# `into(name)`, when given, is where the owner may build the full tensor (a contiguous tensor of its shape in the
# engine dtype: a slice of the bucket being filled, so no copy follows) or None.
class GatherOwned(Protocol):
    def __call__(
        self,
        names: list[str],
        dtype: torch.dtype | None,
        owner: dict[str, int],
        into: Callable[[str], torch.Tensor | None] | None = None,
    ) -> Iterator[tuple[str, torch.Tensor | None]]: ...


# write_rows(names, views): every rank writes its own part of each tensor of `names` (cast) into `views` (full-size
# buffers every rank maps: a shared-memory bucket on this host), at the same time; no shard crosses a process
# boundary (lichen.train.fsdp.write_local_rows). Where a sender has none, the tensors are gathered.
WriteRows = Callable[[list[str], list[torch.Tensor]], None]


# Fault injection for tests: "R:K" makes trainer rank R SIGKILL itself inside the K-th bucket it takes part in
# broadcasting (1-based, counted over the process's life), right after that bucket's first tensor is gathered:
# the rank is lost mid-broadcast at a chosen point, not at a chosen time (tests/test_ray_rank_killed_in_sync.py).
# "R:K:FILE" fires only while FILE exists and removes it: once per run, not again in the ranks a recovery restarts
# with the same environment (scripts/chaos_run.py).
KILL_IN_BUCKET_ENV = "LICHEN_TEST_KILL_RANK_IN_BUCKET"


def _kill_point(rank: int, bucket: int) -> bool:
    """Whether KILL_IN_BUCKET_ENV names this rank and bucket (unset, or anything else: no)."""
    point = f"{rank}:{bucket}"
    want = os.environ.get(KILL_IN_BUCKET_ENV, "")
    if want == point:
        return True
    if not want.startswith(point + ":"):
        return False
    try:
        os.unlink(want[len(point) + 1 :])
    except FileNotFoundError:  # fired already
        return False
    return True


def engine_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` as an engine of `dtype` holds it: detached, floating point cast, contiguous (same device)."""
    t = t.detach()
    if t.is_floating_point() and t.dtype != dtype:
        t = t.to(dtype)
    return t.contiguous()


def tensor_meta(name: str, t: torch.Tensor) -> list:
    """[name, global shape, dtype name, device type] of one trainer tensor (a DTensor reports its full shape)."""
    return [name, list(t.shape), dtype_name(t.dtype), t.device.type]


def engine_nbytes_of(shape: Iterable[int], trainer_dtype: str, dtype: torch.dtype) -> int:
    """Bytes of a tensor of `shape` once floating-point tensors are cast to the engine dtype `dtype`."""
    n = 1
    for d in shape:
        n *= int(d)
    src = parse_dtype(trainer_dtype)
    return n * (dtype.itemsize if src.is_floating_point else src.itemsize)


def sent_dtype(trainer_dtype: str, dtype: torch.dtype) -> str:
    """The dtype name a tensor of `trainer_dtype` travels in: the engine dtype `dtype` if it is floating point."""
    src = parse_dtype(trainer_dtype)
    return dtype_name(dtype if src.is_floating_point else src)


def plan_meta_buckets(meta: list[list], dtype: torch.dtype, buffer_size: int) -> list[list[list]]:
    """The tensors of `meta` (tensor_meta rows) in order, grouped into buckets of at most `buffer_size` bytes in
    the engine dtype (a larger tensor alone): the plan the driver sends and every rank follows."""
    out: list[list[list]] = []
    bucket: list[list] = []
    used = 0
    for row in meta:
        size = engine_nbytes_of(row[1], row[2], dtype)
        if bucket and used + size > buffer_size:
            out.append(bucket)
            bucket, used = [], 0
        bucket.append(row)
        used += size
    if bucket:
        out.append(bucket)
    return out


def master_address(urls: list[str]) -> str:
    """This process's address as the engines reach it: loopback when they all run here, else the local address
    of the route to the first engine (a UDP connect sends nothing)."""
    hosts = [urlsplit(u).hostname or "127.0.0.1" for u in urls]
    if all(h in ("127.0.0.1", "localhost", "::1") for h in hosts):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((hosts[0], urlsplit(urls[0]).port or 80))
        return s.getsockname()[0]


class RankSender:
    """One process's sending half. `rank` is its rank among the trainer's ranks (0 sends and owns the group)."""

    def __init__(
        self,
        rank: int,
        gather: Gather,
        meta: Callable[[], list[list]],
        gather_owned: GatherOwned | None = None,
        write_rows: WriteRows | None = None,
    ):
        self.rank, self._gather, self._meta, self._gather_owned = rank, gather, meta, gather_owned
        self._write_rows = write_rows
        self._shares_shm: bool | None = None  # whether every rank maps rank 0's shared memory (asked once)
        self._store: Any = None
        self._host: str | None = None
        self._delta: Any = None  # lichen.weights.rank_delta.RankDeltaWriter, at the first delta_part
        self._held: Any = None  # tensor_bucket's shared bucket, until the engines answered
        self._buckets = 0  # broadcast buckets gathered, for the fault injection (KILL_IN_BUCKET_ENV)
        self._ahead: Any = None  # ((names, engine dtype), flat, sums): the bucket `broadcast` gathered ahead
        self._pool = BucketPool()  # CPU buckets of this sync that nobody reads any more, reused by the next ones
        self.group: Any = None

    def meta(self) -> list[list]:
        """tensor_meta of every tensor the engines serve, in send order (no gather)."""
        return self._meta()

    # ---- the broadcast group (rank 0 only) ----------------------------------------------------------------
    def group_store(self, urls: list[str], world_size: int, timeout_s: float) -> tuple[str, int]:
        """Rank 0: a new TCPStore for a group of `world_size` on the address the engines at `urls` reach this
        process at; returns (address, port). A group still held is closed first (the engines' side was
        destroyed)."""
        self.group_close()
        self._ahead = None
        host = master_address(urls)
        self._store = master_store(host, world_size, timeout_s)
        self._host = host
        return host, int(self._store.port)

    def group_join(self, backend: str, world_size: int, group_name: str, timeout_s: float) -> None:
        """Rank 0: create rank 0 of the group on the store of `group_store`; returns once every engine joined."""
        self.group = open_group(
            backend=backend,
            master_address=str(self._host),
            master_port=int(self._store.port),
            rank=0,
            world_size=world_size,
            group_name=group_name,
            timeout_s=timeout_s,
            store=self._store,
        )

    def group_close(self) -> None:
        self._ahead = None
        self._pool.clear()
        if self.group is not None:
            self.group.close()
        self.group = self._store = None

    # ---- sending ------------------------------------------------------------------------------------------
    def gathered(self, names: list[str], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor in the engine dtype) one at a time, on every rank (each one a collective)."""
        for name, t in self._gather(names, dtype):
            yield name, engine_cast(t, dtype)

    def to_rank0(
        self, names: list[str], dtype: torch.dtype, into: Callable[[str], torch.Tensor | None] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor in the engine dtype) one at a time on rank 0, gathered into it only where the ranks
        can (gather_owned; built in `into(name)` where it can); every rank takes part and iterates to the end, the
        others get nothing."""
        for name, t in self._owned(names, dtype, dict.fromkeys(names, 0), into):
            if t is not None:
                yield name, t

    def broadcast(
        self, names: list[str], engine_dtype: str, flattened: bool = True, then: list[str] | None = None
    ) -> dict[str, str] | None:
        """Every rank: gather the bucket `names`; rank 0 broadcasts it in the engine dtype (one flattened uint8
        tensor, each tensor's bytes in `names` order, or tensor by tensor) and returns {name: xxh3-128} of what it
        sent; other ranks return None.

        `then` (flattened only) names the next bucket: every rank gathers it while rank 0's broadcast of this one
        is in flight, and the next call finds it gathered. The gather (into rank 0, over the trainer's group)
        and the broadcast (out of rank 0, over the weight group) then overlap instead of taking turns; rank 0
        holds two buckets at most."""
        dtype = parse_dtype(engine_dtype)
        if self.rank == 0 and self.group is None:
            raise RuntimeError("the weight broadcast group is not formed on trainer rank 0")
        if not flattened:
            return self._broadcast_each(names, dtype)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == (tuple(names), engine_dtype):
            flat, sums = ahead[1], ahead[2]
        else:  # the first bucket of a sync (or a sync after a failed one: what was gathered ahead is dropped)
            flat, sums = self._fill(names, dtype)
        work = self.group.broadcast_async(flat) if self.rank == 0 else None
        try:
            if then:
                self._ahead = ((tuple(then), engine_dtype), *self._fill(then, dtype))
        finally:
            if work is not None:
                work.wait()
        if flat is not None and then:  # broadcast: the next bucket but one may reuse its memory
            self._pool.give(flat)
        elif not then:  # the sync's last bucket: nothing stays allocated until the next sync
            self._pool.clear()
        return sums if self.rank == 0 else None

    def _fill(self, names: list[str], dtype: torch.dtype) -> tuple[torch.Tensor | None, dict[str, str]]:
        """Every rank gathers the bucket `names`; rank 0 returns it as one flattened uint8 tensor (each tensor's
        bytes in order: built in its place there by the exchange, else copied in and dropped) with
        {name: xxh3-128}; other ranks return (None, {})."""
        rows = {row[0]: row for row in self._meta()}
        shared = self._fill_shared(names, dtype, rows)
        if shared is not None:
            return shared
        if self._follow(names, dtype):
            return None, {}
        device = self._send_device(rows[names[0]])
        sizes = [engine_nbytes_of(rows[n][1], rows[n][2], dtype) for n in names]
        total = sum(sizes)
        flat = self._pool.reuse(total, shared=False) if device.type == "cpu" else None
        if flat is None:
            flat = torch.empty(total, dtype=torch.uint8, device=device)
        views: dict[str, torch.Tensor] = {}  # each tensor's place in the bucket: the exchange builds it there
        at = 0
        for n, size in zip(names, sizes):
            try:
                views[n] = flat[at : at + size].view(parse_dtype(sent_dtype(rows[n][2], dtype))).view(rows[n][1])
            except RuntimeError:  # an offset its dtype cannot start at (mixed dtypes): built apart, copied in
                pass
            at += size
        sums: dict[str, str] = {}
        offset = 0
        for name, t in self.to_rank0(names, dtype, views.get):
            sums[name] = tensor_checksum(t)
            size = t.numel() * t.element_size()
            if name not in views or t.data_ptr() != views[name].data_ptr():  # not built in place: copied in
                flat[offset : offset + size].copy_(t.reshape(-1).view(torch.uint8))
            offset += size
        if offset != total:
            raise RuntimeError(f"bucket {names[:3]}...: gathered {offset} bytes, planned {total}")
        return flat, sums

    def _fill_shared(
        self, names: list[str], dtype: torch.dtype, rows: dict[str, list]
    ) -> tuple[torch.Tensor | None, dict[str, str]] | None:
        """`_fill` where the ranks map rank 0's shared memory (lichen.weights.rank_shm): the bucket packed as the
        broadcast sends it, every rank writing its own rows. None (on every rank) where it does not apply: CUDA
        weights, one rank, no write_rows, a tensor whose packed offset its dtype cannot start at, or a bucket
        larger than /dev/shm has free (then it is gathered)."""
        if self._write_rows is None or rows[names[0]][3] != "cpu" or not self._host_shared():
            return None
        from lichen.weights.rank_shm import fill_shared
        from lichen.weights.shm_buckets import shm_empty, shm_free_bytes

        layout = [(parse_dtype(sent_dtype(rows[n][2], dtype)), rows[n][1]) for n in names]
        sizes = [engine_nbytes_of(rows[n][1], rows[n][2], dtype) for n in names]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        if any(off % want.itemsize for (want, _), off in zip(layout, offsets)):
            return None  # mixed dtypes packed at an odd offset: the gather path builds such a tensor apart

        def alloc() -> torch.Tensor | None:
            flat = self._pool.reuse(sum(sizes), shared=True)
            if flat is not None:
                return flat
            free = shm_free_bytes()
            if free is not None and sum(sizes) > free:
                return None
            return shm_empty(sum(sizes))

        def views_of(flat: torch.Tensor) -> list[torch.Tensor]:
            return [
                flat[off : off + size].view(want).view(tuple(shape))
                for (want, shape), off, size in zip(layout, offsets, sizes)
            ]

        def counted() -> None:  # another rank, the bucket mapped: the fault injection's point (as in _follow)
            self._buckets += 1
            if _kill_point(self.rank, self._buckets):
                os.kill(os.getpid(), signal.SIGKILL)

        done = fill_shared(self.rank, names, alloc, views_of, self._write_rows, counted)
        if done is None:
            return None
        if self.rank == 0:
            self._buckets += 1
        return done.flat, done.sums

    def _broadcast_each(self, names: list[str], dtype: torch.dtype) -> dict[str, str] | None:
        """`broadcast` tensor by tensor (not flattened): each gathered tensor is broadcast as it comes."""
        if self._follow(names, dtype):
            return None
        device = self._send_device(next(row for row in self._meta() if row[0] == names[0]))
        sums: dict[str, str] = {}
        for name, t in self.to_rank0(names, dtype):
            sums[name] = tensor_checksum(t)
            self.group.broadcast(t.to(device))
        return sums

    def _follow(self, names: list[str], dtype: torch.dtype) -> bool:
        """Count one more broadcast bucket; on a rank other than 0, take part in its gathers (where the fault
        injection of KILL_IN_BUCKET_ENV fires) and return True; rank 0 returns False and gathers itself."""
        self._buckets += 1
        if self.rank == 0:
            return False
        for i, _ in enumerate(self._owned(names, dtype, dict.fromkeys(names, 0))):
            if i == 0 and _kill_point(self.rank, self._buckets):
                os.kill(os.getpid(), signal.SIGKILL)
        return True

    def _send_device(self, first: list) -> torch.device:
        """Where rank 0 stages a bucket whose first tensor has the tensor_meta row `first`: its CUDA device when
        the group is NCCL and the weights are on CUDA."""
        if self.group is not None and self.group.backend == "nccl" and first[3] == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def write_full(
        self, tmp_dir: str, engine_dtype: str, buffer_size: int, metadata: dict[str, str]
    ) -> dict[str, Any] | None:
        """Every rank writes its share of a full version into `tmp_dir`: each tensor gathered into the rank that
        owns it and streamed into that rank's current file (lichen.weights.rank_full), never a whole file held.
        Rank 0 returns {"weight_map", "sums" (xxh3-128 of what was written), "total_bytes", "ranks", "write_s"};
        other ranks None."""
        from lichen.weights.rank_full import plan_rank_files, sync_layout, write_rank_files
        from lichen.weights.rank_owners import world

        dtype = parse_dtype(engine_dtype)
        meta = self._meta()
        files = plan_rank_files(meta, dtype, world()[1], int(buffer_size))
        owner = {name: f.rank for f in files for name in f.tensors}
        owned = self._owned([r[0] for r in meta], dtype, owner)
        return write_rank_files(self.rank, files, owned, sync_layout(meta, dtype), tmp_dir, metadata)

    def delta_part(
        self,
        tmp_dir: str,
        kind: str,
        version: int,
        chain_id: str,
        engine_dtype: str,
        encoding: str,
        checksum_format: str,
        level: int = 1,
    ) -> dict[str, Any] | None:
        """Each tensor is gathered into the rank that owns it; each rank writes the part of version `version` it
        owns (a `disk` delta version encoded by the owning ranks, lichen.weights.rank_delta) into `tmp_dir`; rank 0
        returns the merged weight map and checksums, other ranks None."""
        from lichen.weights.rank_delta import PartSpec, RankDeltaWriter
        from lichen.weights.rank_owners import owner_partition, world

        dtype = parse_dtype(engine_dtype)
        meta = self._meta()
        owner = owner_partition(((r[0], engine_nbytes_of(r[1], r[2], dtype)) for r in meta), world()[1])
        if self._delta is None:
            self._delta = RankDeltaWriter(self.rank)
        return self._delta.part(
            self._owned([r[0] for r in meta], dtype, owner),
            PartSpec(tmp_dir, kind, version, chain_id, encoding, checksum_format, level),
        )

    def _owned(
        self,
        names: list[str],
        dtype: torch.dtype,
        owner: dict[str, int],
        into: Callable[[str], torch.Tensor | None] | None = None,
    ) -> Iterator[tuple[str, torch.Tensor | None]]:
        """(name, full tensor in the engine dtype) for the tensors this rank owns, (name, None) for the others."""
        if self._gather_owned is None:
            for name, t in self.gathered(names, dtype):
                yield name, (t if owner[name] == self.rank else None)
            return
        for name, got in self._gather_owned(names, dtype, owner, into):
            yield name, (None if got is None else engine_cast(got, dtype))

    def tensor_bucket(self, names: list[str], engine_dtype: str, entries: int) -> dict[str, Any] | None:
        """Every rank: gather the bucket `names` (into rank 0 only when it serves every entry, else into every
        rank), hold it in shared memory (CUDA memory on a GPU rank) when this rank serves any of the `entries`
        engine TP ranks, and serialize a handle per entry it serves. Rank 0
        returns {"handles": one per entry, in order, "sums": {name: xxh3-128}, "fill_s": seconds}; others None."""
        import time

        import torch.distributed as dist

        from lichen.weights.shm_buckets import alloc_bucket, serialize

        self._recycle_held()
        dtype = parse_dtype(engine_dtype)
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        mine = [j for j in range(int(entries)) if j % world == rank]  # rank 0 always serves entry 0
        rows = {row[0]: row for row in self._meta()}
        if self._write_rows is not None and rows[names[0]][3] == "cpu" and self._host_shared():
            return self._shared_bucket(names, dtype, rows, int(entries))
        views: list[tuple[str, torch.Tensor]] = []
        if mine:  # the bucket's memory first, then each full tensor copied (cast) into it and dropped
            on_cuda = rows[names[0]][3] == "cuda"
            device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
            specs = [(n, rows[n][1], parse_dtype(rows[n][2])) for n in names]
            flat, views = alloc_bucket(specs, dtype, device, self._pool)
            self._held = (flat, views)
        sums: dict[str, str] = {}
        fill_s = 0.0
        if {j % world for j in range(int(entries))} <= {0}:
            # rank 0 serves every entry (one engine TP rank, or one trainer rank): the tensors go into rank 0
            # only, built in their place in the shared bucket where the exchange can (as `_fill` does)
            into = dict(views).get if views else None
            tensors = self._owned(names, dtype, dict.fromkeys(names, 0), into)
        else:  # several ranks serve: each needs the whole bucket
            tensors = self._gather(names, dtype)
        for i, (name, t) in enumerate(tensors):  # collectives: every rank takes part, in the same order
            if views and t is not None and t.data_ptr() != views[i][1].data_ptr():  # not built in place: copy
                t0 = time.perf_counter()
                views[i][1].copy_(t.detach())
                fill_s += time.perf_counter() - t0
            if rank == 0:
                sums[name] = tensor_checksum(views[i][1])  # the bytes the engines will read
            del t
        handles: dict[int, str] = {}
        if views:
            if views[0][1].is_cuda:
                torch.cuda.synchronize(views[0][1].device)  # the engine reads the bytes through its own stream
            handles = {j: serialize(views) for j in mine}  # each its own reference, released by its engine
        parts: list[Any] = [None] * world
        if world > 1:
            dist.gather_object(handles, parts if rank == 0 else None, dst=0)
        else:
            parts = [handles]
        if rank != 0:
            return None
        merged = {j: h for part in parts for j, h in part.items()}
        return {"handles": [merged[j] for j in range(int(entries))], "sums": sums, "fill_s": fill_s}

    def _host_shared(self) -> bool:
        """Every rank: whether every rank maps rank 0's shared memory (lichen.weights.rank_shm.host_shared), asked
        once per sender, and only with several ranks."""
        if self._shares_shm is None:
            import torch.distributed as dist

            from lichen.weights.rank_shm import host_shared

            several = dist.is_initialized() and dist.get_world_size() > 1
            self._shares_shm = several and host_shared(self.rank)
        return self._shares_shm

    def _shared_bucket(self, names: list[str], dtype: torch.dtype, rows: dict[str, list], entries: int) -> Any:
        """tensor_bucket where every rank maps rank 0's shared memory (lichen.weights.rank_shm): the bucket in
        alloc_bucket's layout, every rank writing its own rows; rank 0 holds it and serializes a handle per engine
        TP rank (each its own reference), all of the one bucket."""
        from lichen.weights.rank_shm import fill_shared
        from lichen.weights.shm_buckets import alloc_bucket, bucket_views, serialize

        assert self._write_rows is not None
        specs = [(n, rows[n][1], parse_dtype(rows[n][2])) for n in names]
        done = fill_shared(
            self.rank,
            names,
            lambda: alloc_bucket(specs, dtype, torch.device("cpu"), self._pool)[0],  # ConfigError: /dev/shm too small
            lambda flat: [v for _, v in bucket_views(flat, specs, dtype)],
            self._write_rows,
        )
        assert done is not None  # alloc never returns None
        if self.rank != 0:
            return None
        views = list(zip(names, done.views))
        self._held = (done.flat, views)
        return {"handles": [serialize(views) for _ in range(entries)], "sums": done.sums, "fill_s": done.fill_s}

    def _recycle_held(self) -> None:
        """The bucket `tensor_bucket` held becomes a spare: the driver asks for the next bucket only once every
        engine has answered for this one (copied it out), so its memory can take the next bucket's bytes."""
        if self._held is not None:
            self._pool.give(self._held[0])
            self._held = None

    def tensor_release(self) -> None:
        """Drop the bucket `tensor_bucket` holds and the spares (every engine has copied it out: the sync ended)."""
        self._held = None
        self._pool.clear()

    def rows(self, names: list[str], engine_dtype: str, n: int | None) -> dict[str, torch.Tensor] | None:
        """Every rank gathers `names`; rank 0 returns the first `n` rows (all with None) of each in the engine
        dtype, on CPU (the sampled check of engines that report no lichen checksums)."""
        dtype = parse_dtype(engine_dtype)
        out: dict[str, torch.Tensor] = {}
        for name, t in self.to_rank0(names, dtype):
            if self.rank == 0:
                out[name] = (t[:n] if (n is not None and t.dim()) else t).to("cpu").clone()
        return out if self.rank == 0 else None


def local_gather(state: dict[str, torch.Tensor]) -> Gather:
    """`gather` over tensors this process holds whole (the single-rank trainer's)."""

    def gather(names: list[str], dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name in names:  # whole already: nothing to gather, the caller casts
            yield name, state[name]

    return gather
