"""Weight sync into vLLM servers (`--rollout-engine-backend vllm`; docs/engines.md#weight-sync).

vLLM's own weight-transfer backends (`nccl`, `ipc`) are CUDA-only, so on CPU lichen's receiver runs inside vLLM's
worker (lichen.engines.clients.vllm_worker_ext, loaded with `--worker-extension-cls`) and is driven through
`/collective_rpc`; the trainer's side is the same sender as every other transport (lichen.weights.rank_send:
trainer rank 0 under --runtime ray, else this process):

- `VLLMGlooSync` (`--update-weight-transport nccl`, weights on CPU): the broadcast transport of
  lichen.sync.distributed — the same gloo group, bucket plan and flattened buckets — with vLLM's endpoints for the
  engine's half (the measured choice, docs/engines.md#weight-sync);
- `VLLMShmSync` (`--update-weight-transport tensor`): each bucket written once into a file in /dev/shm that every
  engine on this host reads (`--runtime local` only: the driver holds the weights);
- `VLLMNativeSync` (`--update-weight-transport nccl`, weights on CUDA): vLLM's protocol, `/init_weight_transfer_engine`,
  `/start_weight_update`, `/update_weights` per bucket, `/finish_weight_update`, with vLLM's trainer-side engine
  (needs vLLM importable beside the trainer). Untested here (no GPU); its request sequence is tested against a
  scripted peer.

Every sync: `POST /pause` (in-flight requests aborted; lichen's rollout continues them from the kept tokens), the
buckets inside vLLM's layerwise reload (`lichen_begin` ... `lichen_finish`), `POST /update_weight_version` so every
sample after it records the version, `POST /resume` (also after a failure). Health probes are suspended meanwhile
(a paused engine is not a dead one). Then every engine must report the version (`GET /weight_info`) and the
xxh3-128 of every tensor it loaded (`lichen_checksums`) must equal the digests of what the sender sent — a
mismatch is a WeightMismatchError, as for every engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from typing import Any, Iterable, Iterator

import torch

from lichen.engines.clients.vllm_worker_ext import RECEIVER as EXTENSION
from lichen.errors import ConfigError
from lichen.observe.metrics import get_logger
from lichen.sync.distributed import BroadcastSync, buckets
from lichen.sync.verify import WeightMismatchError, answered, compare_checksums
from lichen.weights.rank_send import engine_nbytes_of
from lichen.weights.wire import CHECKSUM_FORMAT, dtype_name, parse_dtype, tensor_checksum

log = get_logger(__name__)

RPC = "/collective_rpc"
SHM_DIR = "/dev/shm"


def is_vllm(engines: Any) -> bool:
    """Whether `engines` (a RemoteEngines) are vLLM servers (--rollout-engine-backend vllm: launched, or external
    ones), i.e. reached through lichen.engines.clients.vllm_client."""
    cls = getattr(engines, "_client_cls", None)
    if cls is None:
        return False
    from lichen.engines.clients.vllm_client import VLLMClient

    return isinstance(cls, type) and issubclass(cls, VLLMClient)


def rpc(method: str, arg: dict | None = None, timeout: float | None = None) -> dict:
    """A `/collective_rpc` body: vLLM passes only strings to the workers, so the argument travels as JSON."""
    body: dict[str, Any] = {"method": method, "args": [] if arg is None else [json.dumps(arg)]}
    if timeout is not None:
        body["timeout"] = timeout
    return body


def _each_get(engines: Any, path: str) -> list[Any]:
    """GET `path` from every engine in rotation (JSON answers, in rotation order)."""
    clients = engines._active()

    async def get_all() -> list[Any]:
        import asyncio

        return list(await asyncio.gather(*(c.call_json("GET", path) for c in clients)))

    return engines.run(get_all())


def served_dtype(engines: Any) -> torch.dtype:
    """The dtype every engine in rotation serves in, as lichen's receiver in each reports it (vLLM's HTTP API
    does not say); all must agree."""
    answers = engines.post_each(RPC, rpc("lichen_info"))
    names = {
        str(w.get("dtype")) for a in answers if a is not None for w in (a.get("results") or []) if isinstance(w, dict)
    }
    if len(names) != 1:
        raise WeightMismatchError(
            f"the vLLM engines {engines.active_urls()} report dtypes {sorted(names)}: one sync cannot fit all "
            f"(are they launched with --worker-extension-cls {EXTENSION}?)"
        )
    return parse_dtype(names.pop().removeprefix("torch."))


def make_transport(engines: Any, cfg: Any) -> Any:
    """The vLLM transport for --update-weight-transport `cfg.transport`, or None for `disk` (the fallback: a
    checkpoint per version that the engines reload, as for every engine)."""
    if cfg.transport == "nccl":
        return VLLMGlooSync(engines, buffer_size=cfg.buffer_size)
    if cfg.transport == "tensor":
        from lichen.sync.visibility import check_same_host

        check_same_host(engines)
        return VLLMShmSync(engines, buffer_size=cfg.buffer_size)
    return None


def _sent_metrics(sent: int, buckets: int, t0: float) -> dict:
    """A push's metrics: bytes sent (the whole model: every sync is full), buckets, seconds since `t0`."""
    return {
        "sync/bytes": sent,
        "sync/total_bytes": sent,
        "sync/buckets": buckets,
        "time/sync_transfer": time.perf_counter() - t0,
    }


class _VLLMSide:
    """What every vLLM transport shares: its update session, versions, checksums (mixed into the transports)."""

    engines: Any
    timeout_s: float
    sent_checksums: dict[str, str]

    def _rpc_each(self, method: str, arg: dict | None = None) -> list[Any]:
        return self.engines.post_each(RPC, rpc(method, arg, self.timeout_s), timeout=self.timeout_s + 30)

    @contextlib.contextmanager
    def _update_session(self, version: int) -> Iterator[None]:
        """Paused (vLLM's /pause: running requests aborted, probes suspended; /resume on exit, also after a
        failure), inside vLLM's layerwise reload, then the new version recorded."""
        with self.engines.paused():
            self._rpc_each("lichen_begin")
            yield
            self._rpc_each("lichen_finish")
            self.engines.post_each("/update_weight_version", {"new_version": str(version)})

    def engine_dtype(self) -> torch.dtype:
        return served_dtype(self.engines)

    def verify(self, engines: Any, version: int, expected: dict[str, str] | None = None) -> dict:
        """Every engine's checksums of the tensors it loaded against `expected` (what was sent)."""
        t0 = time.perf_counter()
        want = expected if expected is not None else self.sent_checksums
        urls = engines.active_urls()
        answers = engines.post_each(RPC, rpc("lichen_checksums"), timeout=self.timeout_s)
        checked = 0
        for url, answer in zip(*answered(urls, answers)):
            results = answer.get("results") if isinstance(answer, dict) else None
            if not isinstance(results, list) or not results:
                raise WeightMismatchError(f"engine {url} answered no checksums after the sync to version {version}")
            for worker in results:
                if not isinstance(worker, dict) or worker.get("checksum_format") != CHECKSUM_FORMAT:
                    raise WeightMismatchError(
                        f"engine {url} does not report {CHECKSUM_FORMAT} checksums after the sync to version "
                        f"{version}: {str(worker)[:200]}"
                    )
                checked += compare_checksums(url, want, {"ranks": [worker]}, version)
        return {"time/sync_verify": time.perf_counter() - t0, "sync/verified_tensors": checked}


class VLLMGlooSync(_VLLMSide, BroadcastSync):
    """The broadcast transport (lichen.sync.distributed.BroadcastSync) with vLLM's endpoints on the engine side:
    the worker extension joins the gloo group and receives the flattened buckets. Weights on CUDA go through
    vLLM's own protocol instead (VLLMNativeSync; from this process's weights only)."""

    _native: Any = None

    def push(self, named: Iterable[tuple[str, torch.Tensor]], version: int, dtype: torch.dtype) -> dict:
        items = list(named)
        if items and items[0][1].is_cuda:
            if self._native is None:
                self._native = VLLMNativeSync(self.engines, buffer_size=self.buffer_size, timeout_s=self.timeout_s)
            return self._native.push(items, version, dtype)
        self._native = None
        return super().push(items, version, dtype)

    def verify(self, engines: Any, version: int, expected: dict[str, str] | None = None) -> dict:
        if self._native is not None:
            return self._native.verify(engines, version, expected)
        return super().verify(engines, version, expected)

    def push_from(self, sender: Any, version: int, dtype: torch.dtype) -> dict:
        meta = sender.call("meta", all_ranks=False)
        if meta and meta[0][3] == "cuda":
            raise ConfigError(
                "--update-weight-transport nccl to vLLM engines from CUDA trainer ranks (--runtime ray) is not "
                "available: vLLM's protocol is driven from the lichen train process (--runtime local)"
            )
        return super().push_from(sender, version, dtype)

    def _engine_ranks(self) -> list[int]:
        return [int(b.get("world_size") or 1) for b in _each_get(self.engines, "/get_world_size?include_dp=false")]

    def _leave_engines(self) -> None:
        self._rpc_each("lichen_leave")

    def _post_join(self, payloads: list[dict]) -> Any:
        bodies = [rpc("lichen_join", dict(p, timeout_s=self.timeout_s), self.timeout_s + 30) for p in payloads]
        return self.engines.post_each(RPC, bodies, timeout=self.timeout_s + 60, wait=False)

    def _post_bucket(self, payload: dict, bucket: list[list], dtype: torch.dtype) -> Any:
        if not self.flattened:
            raise ConfigError("vLLM engines receive flattened buckets only")
        total = sum(engine_nbytes_of(row[1], row[2], dtype) for row in bucket)
        arg = {k: payload[k] for k in ("names", "dtypes", "shapes")}
        arg["total"] = total
        return self.engines.post_each(RPC, rpc("lichen_receive", arg, self.timeout_s + 30), wait=False)


class VLLMShmSync(_VLLMSide):
    """Each bucket written once into /dev/shm (the engine dtype, tensors back to back) and read by every engine
    on this host; the file is removed once every engine answered."""

    def __init__(self, engines: Any, *, buffer_size: int, timeout_s: float = 600.0):
        self.engines, self.buffer_size, self.timeout_s = engines, int(buffer_size), timeout_s
        self.sent_checksums = {}

    def close(self) -> None:
        pass

    def push(self, named: Iterable[tuple[str, torch.Tensor]], version: int, dtype: torch.dtype) -> dict:
        admit = getattr(self.engines, "admit_restarted", None)
        if admit is not None:
            admit()
        t0 = time.perf_counter()
        sent = count = 0
        sums: dict[str, str] = {}
        with self._update_session(version):
            for bucket in buckets(named, dtype, self.buffer_size):
                total = sum(t.numel() * t.element_size() for _, t in bucket)
                fd, path = tempfile.mkstemp(prefix="lichen-vllm-", dir=SHM_DIR)
                try:
                    with os.fdopen(fd, "wb") as f:
                        for name, t in bucket:
                            t = t.to("cpu").contiguous()
                            sums[name] = tensor_checksum(t)
                            f.write(t.reshape(-1).view(torch.uint8).numpy().data)
                    arg = {
                        "path": path,
                        "total": total,
                        "names": [n for n, _ in bucket],
                        "dtypes": [dtype_name(t.dtype) for _, t in bucket],
                        "shapes": [list(t.shape) for _, t in bucket],
                    }
                    self._rpc_each("lichen_receive_shm", arg)
                finally:
                    os.unlink(path)
                sent += total
                count += 1
        self.sent_checksums = sums
        return _sent_metrics(sent, count, t0)


class VLLMNativeSync:
    """vLLM's own weight-transfer protocol on CUDA (`nccl` backend), the buckets sent by vLLM's trainer-side
    engine: the servers must run with `--weight-transfer-config '{"backend": "nccl"}'`. `trainer_engine(init_info)`
    gives an object with `send(names, dtype_names, shapes, tensors)`; by default vLLM's own (vLLM must be
    importable beside the trainer)."""

    def __init__(self, engines: Any, *, buffer_size: int, timeout_s: float = 600.0, trainer_engine: Any = None):
        self.engines, self.buffer_size, self.timeout_s = engines, int(buffer_size), timeout_s
        self.trainer_engine = trainer_engine or _vllm_trainer_engine
        self.sent_checksums: dict[str, str] = {}
        self._sender: Any = None
        self._members: tuple[str, ...] | None = None

    def close(self) -> None:
        if self._sender is not None:
            try:
                self.engines.post_each("/shutdown_weight_transfer_engine", {})
            except Exception as e:
                log.warning("shutting down vLLM's weight transfer engine: %s", e)
        self._sender = self._members = None

    def _ensure_group(self) -> None:
        urls = tuple(self.engines.active_urls())
        if self._sender is not None and self._members == urls:
            return
        worlds = [int(b.get("world_size") or 1) for b in _each_get(self.engines, "/get_world_size?include_dp=false")]
        world = 1 + sum(worlds)
        from lichen.engines.clients.sglang_launcher import free_port
        from lichen.weights.rank_send import master_address

        host = master_address(list(urls))
        port = free_port(host)
        bodies, offset = [], 1
        for w in worlds:
            # packed false: the workers receive tensor by tensor, as _vllm_trainer_engine sends them
            info = {"master_address": host, "master_port": port, "rank_offset": offset, "world_size": world}
            bodies.append({"init_info": {**info, "packed": False}})
            offset += w
        pending = self.engines.post_each("/init_weight_transfer_engine", bodies, timeout=self.timeout_s, wait=False)
        self._sender = self.trainer_engine({"master_address": host, "master_port": port, "world_size": world})
        pending.result(self.timeout_s + 30)
        self._members = urls

    def push(self, named: Iterable[tuple[str, torch.Tensor]], version: int, dtype: torch.dtype) -> dict:
        admit = getattr(self.engines, "admit_restarted", None)
        if admit is not None:
            admit()
        t0 = time.perf_counter()
        self._ensure_group()
        sent = count = 0
        sums: dict[str, str] = {}
        with self.engines.paused():
            self.engines.post_each("/start_weight_update", {})
            for bucket in buckets(named, dtype, self.buffer_size):
                info = {
                    "names": [n for n, _ in bucket],
                    "dtype_names": [dtype_name(t.dtype) for _, t in bucket],
                    "shapes": [list(t.shape) for _, t in bucket],
                }
                pending = self.engines.post_each(
                    "/update_weights", {"update_info": info}, timeout=self.timeout_s, wait=False
                )
                self._sender.send(info["names"], info["dtype_names"], info["shapes"], [t for _, t in bucket])
                pending.result(self.timeout_s + 30)
                for name, t in bucket:
                    sums[name] = tensor_checksum(t)
                sent += sum(t.numel() * t.element_size() for _, t in bucket)
                count += 1
            self.engines.post_each("/finish_weight_update", {"weight_version": str(version)})
        self.sent_checksums = sums
        return _sent_metrics(sent, count, t0)

    def engine_dtype(self) -> torch.dtype:
        return served_dtype(self.engines)

    def verify(self, engines: Any, version: int, expected: dict[str, str] | None = None) -> dict:
        """vLLM's `/weight_checker` hashes its own (fused, repacked) parameters with sha256: not the trainer's
        tensors. The check is the version each engine reports; the tensors sent are recorded."""
        return {"sync/verified_tensors": 0}


def _vllm_trainer_engine(init: dict) -> Any:
    """vLLM's trainer-side NCCL endpoint (rank 0 of the group, vllm.distributed.weight_transfer.nccl_common's
    trainer_init) broadcasting tensor by tensor, as the workers expect with `packed: false`; vLLM must be
    importable beside the trainer."""
    try:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init
    except ImportError as e:
        raise ConfigError(
            "--update-weight-transport nccl to vLLM engines on CUDA uses vLLM's trainer-side NCCL endpoint: "
            f"install vLLM beside lichen on the trainer's host ({e})"
        ) from None
    group = trainer_init(init)

    class _Sender:
        def send(self, names: list[str], dtype_names: list[str], shapes: list, tensors: list) -> None:
            for t in tensors:
                group.broadcast(t, src=0, stream=torch.cuda.current_stream())

    return _Sender()
