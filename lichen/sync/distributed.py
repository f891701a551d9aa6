"""Weight sync by torch.distributed broadcast (`--update-weight-transport nccl`; NCCL on GPU, gloo on CPU).

The trainer is rank 0 of a group with the engines (docs/architecture.md#weight-sync); an engine with tensor parallelism
k takes k ranks, so engine i gets `rank_offset = 1 + Σ_{j<i} k_j` and `world_size = 1 + Σ k_j`.

Forming the group (the first sync, and again whenever the engines in rotation change, e.g. when a restarted engine
re-joins: each sync first admits restarted engines, RemoteEngines.admit_restarted):
1. rank 0's TCPStore binds a free port on the trainer's address;
2. `/init_weights_update_group` is posted to every engine without waiting (each call returns once the group
   exists), while the trainer builds its own side of the group; then the answers are checked.

One sync to version N: pause generation and flush caches on every engine, then for each bucket (the trainer's
tensors in order, cast to the engine dtype, at most --update-weight-buffer-size bytes, a larger tensor alone):
post `/update_weights_from_distributed` {names, dtypes, shapes, group_name, weight_version "N",
load_format "flattened_bucket"} to every engine, broadcast the bucket as one uint8 tensor (each tensor's bytes in
`names` order), and wait for every answer; then continue generation.

Forming the group and each broadcast run on a helper thread, so an engine that answers with an error at once
(and so never joins or receives) fails the sync instead of leaving the trainer blocked in the collective until
its timeout; the group is then rebuilt at the next sync.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Iterable, Iterator
from urllib.parse import urlsplit

import torch

from lichen.observe.metrics import get_logger
from lichen.weights.wire import GROUP_TIMEOUT_S, dtype_name, flatten_tensors, master_store, open_group

log = get_logger(__name__)

GROUP_NAME = "lichen"


def master_address(urls: list[str]) -> str:
    """The trainer's address as the engines reach it: loopback when they all run here, else the local address
    of the route to the first engine (a UDP connect sends nothing)."""
    hosts = [urlsplit(u).hostname or "127.0.0.1" for u in urls]
    if all(h in ("127.0.0.1", "localhost", "::1") for h in hosts):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((hosts[0], urlsplit(urls[0]).port or 80))
        return s.getsockname()[0]


def engine_nbytes(t: torch.Tensor, dtype: torch.dtype) -> int:
    """Bytes of `t` once floating-point tensors are cast to the engine dtype `dtype`."""
    return t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size())


def plan_buckets(
    named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, buffer_size: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The (name, tensor) pairs in order, grouped into lists of at most `buffer_size` bytes in the engine dtype
    (a larger tensor forms a bucket of its own); nothing is copied."""
    bucket: list[tuple[str, torch.Tensor]] = []
    used = 0
    for name, t in named:
        size = engine_nbytes(t, dtype)
        if bucket and used + size > buffer_size:
            yield bucket
            bucket, used = [], 0
        bucket.append((name, t))
        used += size
    if bucket:
        yield bucket


def buckets(
    named: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    buffer_size: int,
    device: torch.device | str | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """plan_buckets with each tensor detached, floating-point ones cast to `dtype`, and moved to `device`."""
    for bucket in plan_buckets(named, dtype, buffer_size):
        out = []
        for name, t in bucket:
            t = t.detach()
            if t.is_floating_point() and t.dtype != dtype:
                t = t.to(dtype)
            out.append((name, t if device is None else t.to(device)))
        yield out


def _while_engines_answer(fn, pending, name: str):
    """fn() on a helper thread (a collective call that blocks until every rank joins); raise the engines' error
    as soon as one of them answered with one (it will never join), instead of waiting for the timeout."""
    out: list = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # reported to the caller below
            error.append(e)

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.05)
        if thread.is_alive() and pending.done() and pending.exception() is not None:
            raise pending.exception()
    if error:
        raise error[0]
    return out[0] if out else None


class BroadcastSync:
    """The trainer's side of the broadcast transport for one RemoteEngines. `backend` None picks nccl when the
    trainer's weights are on a CUDA device, else gloo."""

    def __init__(
        self,
        engines: Any,
        *,
        buffer_size: int,
        backend: str | None = None,
        group_name: str = GROUP_NAME,
        timeout_s: float = GROUP_TIMEOUT_S,
        flattened: bool = True,
    ):
        self.engines, self.buffer_size, self.backend = engines, int(buffer_size), backend
        self.group_name, self.timeout_s, self.flattened = group_name, timeout_s, flattened
        self.group = None
        self.members: tuple[str, ...] | None = None
        self.groups_formed = 0

    # ---- group --------------------------------------------------------------------------------------------
    def open(self, backend: str) -> None:
        urls = self.engines.active_urls()
        tps = [max(1, int(i.get("tp_size") or 1)) for i in self.engines.server_infos()]
        world = 1 + sum(tps)
        host = master_address(urls)
        store = master_store(host, world, self.timeout_s)
        payloads, offset = [], 1
        for tp in tps:
            payloads.append(
                {
                    "master_address": host,
                    "master_port": store.port,
                    "rank_offset": offset,
                    "world_size": world,
                    "group_name": self.group_name,
                    "backend": backend,
                }
            )
            offset += tp
        self.engines.destroy_weights_update_group(self.group_name)  # one left by a trainer that died (no-op else)
        pending = self.engines.post_each(
            "/init_weights_update_group", payloads, timeout=self.timeout_s + 30, wait=False
        )
        try:
            group = _while_engines_answer(
                lambda: open_group(
                    backend=backend,
                    master_address=host,
                    master_port=store.port,
                    rank=0,
                    world_size=world,
                    group_name=self.group_name,
                    timeout_s=self.timeout_s,
                    store=store,
                ),
                pending,
                "lichen-weight-group",
            )
        except BaseException:
            pending.cancel()
            raise
        pending.result(self.timeout_s + 60)
        self.group, self.members, self.backend = group, tuple(urls), backend
        self.groups_formed += 1
        log.info(
            "weight broadcast group %r formed: trainer + %d engine rank(s) over %s", self.group_name, world - 1, backend
        )

    def close(self) -> None:
        """Leave the group on both sides (engines that are gone are skipped)."""
        if self.group is None:
            return
        try:
            self.engines.destroy_weights_update_group(self.group_name)
        except Exception as e:
            log.warning("destroying the weight update group on the engines: %s", e)
        self.group.close()
        self.group, self.members = None, None

    def _ensure_group(self, device: torch.device) -> None:
        backend = self.backend or ("nccl" if device.type == "cuda" else "gloo")
        if (
            self.group is not None
            and self.members == tuple(self.engines.active_urls())
            and self.group.backend == backend
        ):
            return
        self.close()  # membership changed (an engine restarted or left rotation): a new group
        self.open(backend)

    # ---- one sync -----------------------------------------------------------------------------------------
    def _broadcast(self, flat: torch.Tensor, pending) -> None:
        try:
            _while_engines_answer(lambda: self.group.broadcast(flat), pending, "lichen-weight-broadcast")
        except BaseException:
            self.group, self.members = None, None  # ranks that never received leave the group stuck: rebuild
            raise

    def push(self, named: Iterable[tuple[str, torch.Tensor]], version: int, dtype: torch.dtype) -> dict:
        """Send the weights as version `version` in the engine dtype; returns metrics (bytes, buckets, seconds)."""
        it = iter(named)
        first = next(it, None)
        if first is None:
            raise ValueError("the trainer has no weights to send")
        device = first[1].device
        if device.type != "cuda":
            device = torch.device("cpu")
        t0 = time.perf_counter()
        admit = getattr(self.engines, "admit_restarted", None)
        if admit is not None:
            admit()  # restarted engines re-join rotation first: the group then includes them (membership changed)
        self._ensure_group(device)
        send_device = device if self.group.backend == "nccl" else torch.device("cpu")
        t1 = time.perf_counter()

        def all_named():
            yield first
            yield from it

        sent = count = 0
        with self.engines.paused():
            for bucket in buckets(all_named(), dtype, self.buffer_size, send_device):
                payload = {
                    "names": [n for n, _ in bucket],
                    "dtypes": [dtype_name(t.dtype) for _, t in bucket],
                    "shapes": [list(t.shape) for _, t in bucket],
                    "group_name": self.group_name,
                    "weight_version": str(version),
                }
                if self.flattened:
                    payload["load_format"] = "flattened_bucket"
                pending = self.engines.post_each(
                    "/update_weights_from_distributed", payload, timeout=self.timeout_s + 30, wait=False
                )
                if self.flattened:
                    flat = flatten_tensors(t for _, t in bucket)
                    self._broadcast(flat, pending)
                else:
                    for _, t in bucket:
                        self._broadcast(t.contiguous(), pending)
                pending.result(self.timeout_s + 60)
                sent += sum(t.numel() * t.element_size() for _, t in bucket)
                count += 1
        t2 = time.perf_counter()
        return {
            "sync/bytes": sent,
            "sync/total_bytes": sent,
            "sync/buckets": count,
            "time/sync_group": t1 - t0,
            "time/sync_transfer": t2 - t1,
        }
