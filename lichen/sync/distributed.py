"""Weight sync by torch.distributed broadcast (`--update-weight-transport nccl`; NCCL on GPU, gloo on CPU).

The sending process (trainer rank 0 under --runtime ray, the `lichen train` process locally; the driver only makes
the HTTP calls, lichen.sync.senders) is rank 0 of a group with the engines (docs/architecture.md#weight-sync); an engine with tensor parallelism
k takes k ranks, so engine i gets `rank_offset = 1 + Σ_{j<i} k_j` and `world_size = 1 + Σ k_j`.

Forming the group (the first sync, and again whenever the engines in rotation change, e.g. when a restarted engine
re-joins: each sync first admits restarted engines, RemoteEngines.admit_restarted):
1. rank 0's TCPStore binds a free port on the sender's address (the one its route to the engines leaves from);
2. `/init_weights_update_group` is posted to every engine without waiting (each call returns once the group
   exists), while the trainer builds its own side of the group; then the answers are checked.

One sync to version N: pause generation and flush caches on every engine, then for each bucket (the trainer's
tensors in order, cast to the engine dtype, at most --update-weight-buffer-size bytes, a larger tensor alone;
planned by the driver from the tensors' names, shapes and dtypes): post `/update_weights_from_distributed`
{names, dtypes, shapes, group_name, weight_version "N", load_format "flattened_bucket"} to every engine, have every
trainer rank gather the bucket (each FSDP2 DTensor's full_tensor(), one tensor at a time) and rank 0 broadcast it
as one uint8 tensor (each tensor's bytes in `names` order), and wait for every answer; then continue generation.
Rank 0 returns the xxh3-128 of each tensor it sent (`sent_checksums`), which lichen.sync.verify compares with
the engines' own.

Forming the group and each broadcast run in the sender (a helper thread or the ranks), so an engine that answers with an error at once
(and so never joins or receives) fails the sync instead of leaving the trainer blocked in the collective until
its timeout; the group is then rebuilt at the next sync.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterable, Iterator

import torch

from lichen.errors import RunError, UserError
from lichen.observe.metrics import get_logger
from lichen.sync.senders import InProcessSender, wait_with_engines
from lichen.weights.rank_send import engine_nbytes_of, plan_meta_buckets, sent_dtype
from lichen.weights.wire import GROUP_TIMEOUT_S, dtype_name

log = get_logger(__name__)

GROUP_NAME = "lichen"


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


def engines_named(urls: Iterable[str] | None) -> str:
    """'engine 0 (URL), engine 1 (URL)' for the engines of a group, as a failure message names them."""
    return ", ".join(f"engine {i} ({u})" for i, u in enumerate(urls or ())) or "no engine"


def add_context(error: BaseException, where: str) -> None:
    """Append ` (during <where>)` to `error`'s one-line message where it is one of lichen's own errors (RunError,
    UserError: the CLI prints their message alone); its type and attributes stay (a RankFailed keeps its rank)."""
    if isinstance(error, (RunError, UserError)) and len(error.args) == 1 and isinstance(error.args[0], str):
        error.args = (f"{error.args[0]} (during {where})",)


class BroadcastSync:
    """The driver's side of the broadcast transport for one RemoteEngines: the group's HTTP calls and the bucket
    plan; the tensors go from the sender (lichen.sync.senders: the trainer ranks under --runtime ray, else this
    process) to the engines. `backend` None picks nccl when the trainer's weights are on a CUDA device, else
    gloo."""

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
        self.sender: Any = None  # the sender the group was formed with (it holds rank 0 of the group)
        self.members: tuple[str, ...] | None = None
        self.groups_formed = 0
        self.sent_checksums: dict[str, str] = {}  # {name: xxh3-128} of the last sync, for lichen.sync.verify
        self._local: InProcessSender | None = None

    # ---- the engines' side (SGLang's and lichen serve's endpoints; lichen.sync.vllm_sync overrides them) ------
    def _engine_ranks(self) -> list[int]:
        """Group ranks each engine in rotation takes (its tensor-parallel size)."""
        return [max(1, int(i.get("tp_size") or 1)) for i in self.engines.server_infos()]

    def _leave_engines(self) -> None:
        self.engines.destroy_weights_update_group(self.group_name)

    def _post_join(self, payloads: list[dict]) -> Any:
        """Ask engine i to join the group as `payloads[i]` says; a Future of the answers (they come once the
        group exists)."""
        return self.engines.post_each("/init_weights_update_group", payloads, timeout=self.timeout_s + 30, wait=False)

    def _post_bucket(self, payload: dict, bucket: list[list], dtype: torch.dtype) -> Any:
        """Ask every engine to receive one bucket (`payload`; `bucket` its tensor_meta rows); a Future."""
        return self.engines.post_each(
            "/update_weights_from_distributed", payload, timeout=self.timeout_s + 30, wait=False
        )

    def _update_session(self, version: int) -> Any:
        """Context manager around one sync's buckets: generation paused and caches flushed inside."""
        return self.engines.paused()

    # ---- group --------------------------------------------------------------------------------------------
    def open(self, sender: Any, backend: str) -> None:
        urls = self.engines.active_urls()
        tps = self._engine_ranks()
        world = 1 + sum(tps)
        host, port = sender.call("group_store", urls, world, self.timeout_s, all_ranks=False)
        payloads, offset = [], 1
        for tp in tps:
            payloads.append(
                {
                    "master_address": host,
                    "master_port": port,
                    "rank_offset": offset,
                    "world_size": world,
                    "group_name": self.group_name,
                    "backend": backend,
                }
            )
            offset += tp
        self._leave_engines()  # a group left by a trainer that died (no-op else)
        pending = self._post_join(payloads)
        joined = sender.submit("group_join", backend, world, self.group_name, self.timeout_s, all_ranks=False)
        try:
            wait_with_engines(joined, pending)
        except BaseException:
            pending.cancel()
            raise
        pending.result(self.timeout_s + 60)
        self.sender, self.members, self.backend = sender, tuple(urls), backend
        self.groups_formed += 1
        log.info(
            "weight broadcast group %r formed: trainer + %d engine rank(s) over %s", self.group_name, world - 1, backend
        )

    def close(self) -> None:
        """Leave the group on both sides (engines that are gone are skipped)."""
        if self.sender is not None:
            try:
                self._leave_engines()
            except Exception as e:
                log.warning("destroying the weight update group on the engines: %s", e)
            try:
                self.sender.call("group_close", all_ranks=False)
            except Exception as e:  # the trainer's ranks already gone
                log.warning("closing the trainer's side of the weight update group: %s", e)
            self.sender, self.members = None, None
        if self._local is not None:
            self._local.close()
            self._local = None

    def _ensure_group(self, sender: Any, backend: str) -> None:
        if self.sender is sender and self.members == tuple(self.engines.active_urls()) and self.backend == backend:
            return
        if self.sender is not None:  # membership changed (an engine restarted or left rotation): a new group
            try:
                self._leave_engines()
            except Exception as e:
                log.warning("destroying the weight update group on the engines: %s", e)
        self.sender, self.members = None, None
        self.open(sender, backend)

    # ---- one sync -----------------------------------------------------------------------------------------
    def push(self, named: Iterable[tuple[str, torch.Tensor]], version: int, dtype: torch.dtype) -> dict:
        """Send `named` (tensors this process holds) as version `version` in the engine dtype; returns metrics."""
        if self._local is None:
            self._local = InProcessSender()
        return self.push_from(self._local.bind(named), version, dtype)

    def push_from(self, sender: Any, version: int, dtype: torch.dtype) -> dict:
        """Send the sender's weights as version `version` in the engine dtype, bucket by bucket; returns metrics
        (bytes, buckets, seconds). The checksums of what was sent are left in `sent_checksums`."""
        meta = sender.call("meta", all_ranks=False)
        if not meta:
            raise ValueError("the trainer has no weights to send")
        t0 = time.perf_counter()
        admit = getattr(self.engines, "admit_restarted", None)
        if admit is not None:
            admit()  # restarted engines re-join rotation first: the group then includes them (membership changed)
        self._ensure_group(sender, self.backend or ("nccl" if meta[0][3] == "cuda" else "gloo"))
        t1 = time.perf_counter()
        sent = count = 0
        sums: dict[str, str] = {}
        with self._update_session(version):
            plan = plan_meta_buckets(meta, dtype, self.buffer_size)
            for k, bucket in enumerate(plan, 1):
                names = [row[0] for row in bucket]
                payload = {
                    "names": names,
                    "dtypes": [sent_dtype(row[2], dtype) for row in bucket],
                    "shapes": [row[1] for row in bucket],
                    "group_name": self.group_name,
                    "weight_version": str(version),
                }
                if self.flattened:
                    payload["load_format"] = "flattened_bucket"
                pending = self._post_bucket(payload, bucket, dtype)
                # the ranks gather the next bucket while this one is on the wire (RankSender.broadcast)
                then = [row[0] for row in plan[k]] if self.flattened and k < len(plan) else None
                fut = sender.submit("broadcast", names, dtype_name(dtype), self.flattened, then)
                try:
                    sums.update(wait_with_engines(fut, pending) or {})
                except BaseException as e:
                    where = f"bucket {k} of {len(plan)} of weight version {version} to " + engines_named(self.members)
                    self.sender, self.members = None, None  # ranks that never received leave the group stuck
                    add_context(e, where)
                    raise
                pending.result(self.timeout_s + 60)
                sent += sum(engine_nbytes_of(row[1], row[2], dtype) for row in bucket)
                count += 1
        self.sent_checksums = sums
        t2 = time.perf_counter()
        return {
            "sync/bytes": sent,
            "sync/total_bytes": sent,
            "sync/buckets": count,
            "time/sync_group": t1 - t0,
            "time/sync_transfer": t2 - t1,
        }
