"""The ranks' half of `disk` delta sync under `--runtime ray`: each parameter's delta is encoded by the one rank that
owns it (docs/runtimes.md, docs/weight-format.md).

The owners are a fixed partition of the parameter names (`owner_partition`: largest first to the least loaded
rank, by engine-dtype bytes; the same on every rank, from the same metadata). At each version each tensor is
gathered into its owner only (every rank sends its FSDP2 shards to their owners, one all-to-all per 32 MiB of
tensors, asked in the same order everywhere: lichen.train.fsdp.owned_tensors), so a rank receives and holds only
what it owns; each rank encodes its tensors against its own CPU snapshot of the previous version as they arrive
(the next group's exchange runs meanwhile) — the ranks gather and encode at the same time, so publish time
divides by their number. A full version's tensors
are copied into the snapshot; a delta's are only read (the encoder moves the snapshot to the new bytes in place),
so a rank that holds a tensor whole encodes straight from it. Each rank writes one safetensors file of its
tensors (`model-{rank+1:05d}-of-{world:05d}.safetensors`, in the published format: engine dtype and per-tensor
checksums for a full version, the zstd payloads of the changed tensors for a delta) into the version's temporary
directory; the ranks then exchange what they wrote (an all-gather of small dicts) and rank 0
returns the merged weight map and checksums. The driver (lichen.sync.disk_delta) writes the index last and
renames the directory into place, so engines apply the version exactly as one the driver published itself.

Memory per rank: its owned tensors once gathered (model / ranks in the engine dtype) and its snapshot (the same
again), plus two exchanges' shards (2 x 32 MiB) while they are sent.

Errors: a rank that fails to encode or write still joins the exchange, so every rank raises the same error and
none is left waiting in a collective.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import safetensors.numpy
import safetensors.torch
import torch

from lichen.weights import diff_kernel
from lichen.weights.delta_codec import checksum, encode_tensor_cast, tensor_bytes
from lichen.weights.hf_io import _fsync_file
from lichen.weights.parallel import default_threads, serial_torch
from lichen.weights.rank_owners import all_gather_small, world
from lichen.weights.wire import tensor_checksum

KINDS = ("full", "delta", "hash")  # hash: write nothing, return the checksums (a version the engines already hold)


@dataclass(frozen=True)
class PartSpec:
    """What the driver asks of every rank for one version: where, which kind, which chain, how encoded."""

    tmp_dir: str
    kind: str  # one of KINDS
    version: int
    chain_id: str
    encoding: str
    checksum_format: str
    level: int = 1


class RankDeltaWriter:
    """One rank's owned tensors' snapshot and the version it holds; `part` writes this rank's file of a version."""

    def __init__(self, rank: int):
        self.rank = rank
        self.snapshot: dict[str, torch.Tensor] = {}
        self.holds: tuple[str, int] | None = None  # (chain id, version) the snapshot is

    def part(self, owned: Iterator[tuple[str, torch.Tensor | None]], spec: PartSpec) -> dict[str, Any] | None:
        """Consume `owned` (every tensor's name in the same order on every rank, with its full tensor in the engine
        dtype where this rank owns it, else None), write this rank's file of version `spec.version` into
        `spec.tmp_dir`, exchange with the other ranks; rank 0 returns {"weight_map", "sums" (xxh3-128 of each
        tensor's new bytes, for the driver's verify), "total_bytes", "changed_bytes", "published", "ranks"}; other
        ranks None. A delta's tensors are encoded as they arrive, while the next ones are exchanged."""
        t0 = time.perf_counter()
        gather_s = 0.0  # time spent waiting for `owned` (the exchanges not hidden behind the encode)
        mine: dict[str, torch.Tensor] = {}
        stream: _DeltaStream | None = None
        error: Exception | None = None
        if spec.kind == "delta":
            try:
                stream = _DeltaStream(self, spec)
            except Exception as e:  # still takes part in every exchange below
                error = e
        it = iter(owned)
        while True:
            t1 = time.perf_counter()
            got = next(it, None)
            gather_s += time.perf_counter() - t1
            if got is None:
                break
            name, t = got
            if t is None:
                continue
            if spec.kind == "full" and t.device.type == "cpu":  # kept as the snapshot: never a view of a parameter
                mine[name] = t.clone()
            else:  # a delta only reads it (the encoder updates the snapshot in place), on CPU
                mine[name] = t.to("cpu")
            if stream is not None and error is None:
                try:
                    stream.add(name, mine[name])
                except Exception as e:
                    error = e
        try:
            if error is not None:
                raise error
            encoded = stream.results() if stream is not None else None
            out = {"ok": True, **self._write(mine, spec, encoded), "gather_s": gather_s}
            out["write_s"] = time.perf_counter() - t0 - gather_s
        except Exception as e:  # joins the exchange anyway: every rank raises, none hangs
            self.snapshot, self.holds = {}, None
            out = {"ok": False, "error": f"trainer rank {self.rank}: {type(e).__name__}: {e}"}
        finally:
            if stream is not None:
                stream.close()
        parts = all_gather_small(out)
        bad = [p["error"] for p in parts if not p["ok"]]
        if bad:
            raise RuntimeError(f"publishing weight version {spec.version}: " + "; ".join(bad))
        if self.rank != 0:
            return None
        merged: dict[str, Any] = {"weight_map": {}, "sums": {}, "total_bytes": 0, "changed_bytes": 0, "published": 0}
        for p in parts:
            for key in ("weight_map", "sums"):
                merged[key].update(p[key])
            for key in ("total_bytes", "changed_bytes", "published"):
                merged[key] += p[key]
        merged["ranks"] = len(parts)
        merged["gather_s"] = max(p["gather_s"] for p in parts)  # the slowest rank sets the pace
        merged["write_s"] = max(p["write_s"] for p in parts)
        return merged

    def _write(self, mine: dict[str, torch.Tensor], spec: PartSpec, encoded: dict[str, Any] | None) -> dict[str, Any]:
        tmp_dir, kind, version, chain_id = spec.tmp_dir, spec.kind, spec.version, spec.chain_id
        encoding, checksum_format = spec.encoding, spec.checksum_format
        if kind not in KINDS:
            raise ValueError(f"unknown version kind {kind!r}")
        _, size = world()
        fname = f"model-{self.rank + 1:05d}-of-{size:05d}.safetensors"
        path = os.path.join(tmp_dir, fname)
        total = sum(t.numel() * t.element_size() for t in mine.values())
        sums = {n: tensor_checksum(t) for n, t in mine.items()}
        if kind == "hash":
            return {"weight_map": {}, "sums": sums, "total_bytes": total, "changed_bytes": 0, "published": 0}
        if kind == "full":
            if encoding == "xor" and self.holds is None:  # compile or load the kernel before the first delta
                threading.Thread(target=diff_kernel.warm, name="lichen-diff-kernel-warm", daemon=True).start()
            if mine:
                header = {"format": "pt", **{n: checksum(checksum_format, tensor_bytes(t)) for n, t in mine.items()}}
                safetensors.torch.save_file(mine, path, metadata=header)
                _fsync_file(path)
            self.snapshot, self.holds = mine, (chain_id, version)
            return {"weight_map": dict.fromkeys(mine, fname), "sums": sums, "total_bytes": total,
                    "changed_bytes": 0, "published": len(mine)}  # fmt: skip
        assert encoded is not None  # a delta's tensors were encoded as they arrived (_DeltaStream)
        payloads: dict[str, np.ndarray] = {}
        header = {}
        changed = 0
        for name, e in encoded.items():
            if e is not None:
                payloads[name] = np.frombuffer(e.payload, dtype=np.uint8)
                header[name] = str(e.checksum)
                changed += e.changed_bytes
        if payloads:
            safetensors.numpy.save_file(payloads, path, metadata=header)
            _fsync_file(path)
        self.holds = (chain_id, version)
        return {"weight_map": dict.fromkeys(payloads, fname), "sums": sums, "total_bytes": total,
                "changed_bytes": changed, "published": len(payloads)}  # fmt: skip


class _DeltaStream:
    """The tensors of one delta version encoded as they arrive, against the writer's snapshot of the previous
    version (which each encode moves to the new bytes in place): inline on one weight thread, else on a pool of
    $LICHEN_WEIGHT_THREADS (each tensor its own snapshot, so the threads share nothing). The arrival order must be
    the snapshot's."""

    def __init__(self, writer: RankDeltaWriter, spec: PartSpec):
        version, chain_id = spec.version, spec.chain_id
        self.missing = (
            f"a delta to version {version} needs this rank's snapshot of version {version - 1} of chain "
            f"{chain_id}, it holds {writer.holds} (the driver must publish a full version)"
        )
        if writer.holds != (chain_id, version - 1):
            raise RuntimeError(self.missing)
        writer.holds = None  # the snapshot moves as tensors are encoded: valid again only once all are
        self.writer, self.spec = writer, spec
        self.order = list(writer.snapshot)
        self.encoded: dict[str, Any] = {}  # name -> its encoding, or the Future of it
        threads = default_threads()
        self.pool = ThreadPoolExecutor(max_workers=threads) if threads > 1 else None

    def _encode(self, name: str, t: torch.Tensor) -> Any:
        snap, spec = self.writer.snapshot[name], self.spec
        with serial_torch():
            return encode_tensor_cast(
                spec.encoding, t, tensor_bytes(snap), snap.dtype, checksum_format=spec.checksum_format, level=spec.level
            )

    def add(self, name: str, t: torch.Tensor) -> None:
        if len(self.encoded) >= len(self.order) or self.order[len(self.encoded)] != name:
            raise RuntimeError(self.missing)  # not the tensors the snapshot holds, in its order
        self.encoded[name] = self.pool.submit(self._encode, name, t) if self.pool else self._encode(name, t)

    def results(self) -> dict[str, Any]:
        """{name: encoding (None: unchanged)} in the snapshot's order, once every tensor was added and encoded."""
        if len(self.encoded) != len(self.order):
            raise RuntimeError(self.missing)
        return {n: (e.result() if isinstance(e, Future) else e) for n, e in self.encoded.items()}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
