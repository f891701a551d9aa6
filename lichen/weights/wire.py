"""What trainer and engine agree on when weights travel over the wire (docs/architecture.md#weight-sync).

The standalone torch.distributed group of `/init_weights_update_group` and its broadcast, SGLang's flattened
bucket layout of `/update_weights_from_distributed`, dtype names as requests carry them, and the xxh3-128
checksums of `/weights_checker`. The engine's endpoints (lichen.engines.server.weight_endpoints) and the trainer's
transports (lichen.sync) both import them from here, so neither side reaches into the other.

A leaf: torch and the standard library, and lichen.weights.delta_codec for the checksums.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
from typing import Any, Iterable

import torch

from lichen.weights.delta_codec import checksum, tensor_bytes

log = logging.getLogger(__name__)

DEFAULT_GROUP = "weight_update_group"
CHECKSUM_FORMAT = "xxh3-128"
GROUP_TIMEOUT_S = float(os.environ.get("LICHEN_WEIGHT_GROUP_TIMEOUT", 300))
BACKENDS = ("nccl", "gloo")


class WeightGroup:
    """One rank of a standalone torch.distributed group (not the default group, so a trainer that already runs
    its own torch.distributed world can hold it too). Rank 0 owns the TCPStore."""

    def __init__(self, pg: Any, store: Any, rank: int, world_size: int, backend: str):
        self.pg, self.store, self.rank, self.world_size, self.backend = pg, store, rank, world_size, backend

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast `tensor` in place from rank 0 (rank 0 sends it, the others receive into it)."""
        self.broadcast_async(tensor).wait()

    def broadcast_async(self, tensor: torch.Tensor) -> Any:
        """Start `broadcast`; returns the work handle to `.wait()` on. `tensor` must stay alive and unchanged
        until then."""
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        return self.pg.broadcast([tensor], opts)

    def close(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception as e:  # a peer already gone: nothing left to release
                log.debug("process group shutdown: %s", e)
        self.pg = self.store = None


def master_store(host: str, world_size: int, timeout_s: float = GROUP_TIMEOUT_S) -> Any:
    """The rank-0 TCPStore on a free port (read it back from `.port`): no port is picked in advance."""
    return torch.distributed.TCPStore(
        host, 0, world_size, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


def open_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float = GROUP_TIMEOUT_S,
    store: Any = None,
) -> WeightGroup:
    """Join (rank > 0) or create (rank 0, with its `master_store`) the group; returns once every rank joined."""
    dist = torch.distributed
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(master_address, int(master_port), world_size, False, timeout)
    prefixed = dist.PrefixStore(f"lichen/{group_name}", store)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        if hasattr(opts, "_timeout"):
            opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    else:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return WeightGroup(pg, store, rank, world_size, backend)


def parse_dtype(name: str) -> torch.dtype:
    """A torch dtype from its name without the `torch.` prefix ("bfloat16"), as SGLang's requests carry it."""
    dtype = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; expected a torch dtype name such as 'bfloat16' or 'float32'")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def nbytes(dtype: torch.dtype, shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=dtype).element_size()


def flatten_tensors(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """One uint8 tensor holding each tensor's raw bytes back to back (SGLang's flattened bucket)."""
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def unflatten_tensors(flat: torch.Tensor, dtypes: list[torch.dtype], shapes: list[list[int]]) -> list[torch.Tensor]:
    """Views into `flat` (from flatten_tensors) with the given dtypes and shapes, in order."""
    out, offset = [], 0
    for dtype, shape in zip(dtypes, shapes):
        size = nbytes(dtype, shape)
        out.append(flat[offset : offset + size].view(dtype).reshape(shape))
        offset += size
    if offset != flat.numel():
        raise ValueError(f"the bucket holds {flat.numel()} bytes but its tensors need {offset}")
    return out


def tensor_checksum(t: torch.Tensor) -> str:
    """xxh3-128 hex digest of a tensor's raw bytes in its own dtype (what `/weights_checker` reports)."""
    return checksum(CHECKSUM_FORMAT, tensor_bytes(t.detach().to("cpu")))


def overall_checksum(checksums: dict[str, str]) -> str:
    """sha256 over (name, checksum) in name order: SGLang's per_gpu_checksum."""
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()


def checksum_body(named: Iterable[tuple[str, torch.Tensor]]) -> dict:
    """The `/weights_checker {"action": "checksum"}` answer for one rank holding `named` parameters."""
    sums = {name: tensor_checksum(t) for name, t in named}
    per_gpu = overall_checksum(sums)
    info = {"tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1, "rank": 0, "size": 1}
    return {
        "success": True,
        "message": f"Checksums of {len(sums)} tensors.",
        "checksum_format": CHECKSUM_FORMAT,
        "ranks": [{"checksums": sums, "per_gpu_checksum": per_gpu, "parallelism_info": info}],
        "per_engine_checksum": hashlib.sha256(per_gpu.encode()).hexdigest(),
    }
