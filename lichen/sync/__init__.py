"""Weight sync: publishing the trainer's weights to the engines (docs/architecture.md#weight-sync).

`push` is the only path from trainer to engines. The in-process engine gets a direct tensor copy; server
engines (lichen serve / SGLang, `engine.is_remote`) get the transport chosen by --update-weight-transport and
--update-weight-mode:

- `nccl`: torch.distributed broadcast in buckets (lichen.sync.distributed; NCCL on GPU, gloo on CPU);
- `disk` + `full`: an HF checkpoint per version that the engines reload (lichen.sync.disk);
- `disk` + `delta`: versions holding only what changed, pulled into a host-local copy (lichen.sync.disk_delta);
- `tensor`: handles to the trainer's memory (CUDA IPC, or shared memory on CPU) posted to /update_weights_from_tensor,
  for engines on this host (lichen.sync.tensor_handles).

Every sync pauses generation, flushes caches, updates, records the new weight version and continues (inside the
transports). Then every engine must report the version just published (else StaleEngineError) and serve exactly
the trainer's weights in its dtype (lichen.sync.verify; else WeightMismatchError) — a mismatch is an error.
An engine that fails during the update (an HTTP error, a lost connection) raises SyncError naming the engines and
the weight version; all three are `RunError`s, which the CLI prints as one line with exit code 1.

Transports keep state between syncs (the broadcast group, the publisher's snapshot), one per RemoteEngines.
Metrics per sync: `time/sync` and its parts (`time/sync_publish`, `time/sync_transfer`, `time/sync_apply`,
`time/sync_verify`), `sync/bytes` (bytes on the wire: files written, or bytes broadcast), `sync/total_bytes`
(the model in the engine dtype), `sync/changed_density` (delta versions), `sync/transport_<name>` = 1.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from lichen.engines.clients.client import EngineError
from lichen.errors import ConfigError, NotAvailableYet
from lichen.observe.metrics import get_logger
from lichen.sync.senders import trainer_sender
from lichen.sync.verify import SyncError, WeightMismatchError, engine_dtype, verify_engines, verify_in_process

if TYPE_CHECKING:  # sync does not import lichen.config at run time (docs/architecture.md#import-directions)
    from lichen.config.engine_config import SyncConfig
    from lichen.engines.clients.remote_engines import RemoteEngines

log = get_logger(__name__)

__all__ = ["StaleEngineError", "SyncError", "WeightMismatchError", "push", "close"]


class StaleEngineError(SyncError):
    pass


_STATE_ATTR = "_lichen_sync_state"  # held on the RemoteEngines object, so it lives and dies with it

_ENDPOINTS = {
    "nccl": ("/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group"),
    "delta": ("/pull_weights", "/update_weights_from_disk"),
    "tensor": ("/pause_generation", "/flush_cache", "/update_weights_from_tensor", "/continue_generation"),
}


def push(trainer, rollout, version: int, cfg: SyncConfig | None = None) -> dict:
    """Publish the trainer's current weights as weight version `version` to every engine of `rollout`, as the
    SyncConfig `cfg` says (lichen.config.engine_config; when None, resolved from the rollout's `args`).

    A trainer without weights (the null trainer of --debug-rollout-only) or a rollout without engines (the
    replay of --debug-train-only) makes this a no-op.
    """
    engines = list(getattr(rollout, "engines", []))
    named = getattr(trainer, "named_weights", None)
    if not engines or named is None:
        return {}
    if any(getattr(e, "is_remote", False) for e in engines):
        if cfg is None:
            from lichen.config.engine_config import SyncConfig

            cfg = SyncConfig.from_args(rollout.args)
        return _push_to_servers(trainer, cfg, engines, version)
    t0 = time.perf_counter()
    shared = 0
    for engine in engines:
        # In process the engine serves the trainer's own tensors when they fit (Engine.share_weights): the loop
        # pushes after every train step (no overlap of an in-process engine with training: lichen.config.async_mode),
        # so the optimizer never moves weights under a generation; no copy, one model less in memory.
        share = getattr(engine, "share_weights", None)
        if share is not None:
            shared += bool(share(named(), str(version)))
        else:
            engine.update_weights_from_tensors(named(), str(version))
    stale = [i for i, e in enumerate(engines) if e.weight_version != str(version)]
    if stale:
        raise StaleEngineError(f"engines {stale} did not take weight version {version}")
    t1 = time.perf_counter()
    for engine in engines:
        if hasattr(engine, "model"):
            verify_in_process(engine, named(), version)
    return {
        "time/sync": time.perf_counter() - t0,
        "time/sync_verify": time.perf_counter() - t1,
        "sync/weight_version": version,
        "sync/shared_weights": shared,  # in-process engines serving the trainer's tensors (no copy)
    }


def _state(engines: RemoteEngines, cfg: SyncConfig) -> dict:
    """Per-RemoteEngines state: the engine dtype, the transport object, the endpoint check done once."""
    st = getattr(engines, _STATE_ATTR, None)
    if st is None and _is_vllm(engines):  # broadcast and shared memory through vLLM's endpoints; disk as for all
        from lichen.sync.vllm_sync import make_transport

        vllm_transport = make_transport(engines, cfg)
        if vllm_transport is not None:
            st = {"dtype": vllm_transport.engine_dtype(), "transport": vllm_transport}
            setattr(engines, _STATE_ATTR, st)
    if st is None:
        transport, mode = cfg.transport, cfg.mode
        need = _ENDPOINTS.get(transport if transport in ("nccl", "tensor") else mode, ())
        if need:
            engines.require_endpoints(
                {p: f"--update-weight-transport {transport} --update-weight-mode {mode}" for p in need}
            )
        st = {"dtype": engine_dtype(engines.server_infos()), "transport": _make_transport(engines, cfg)}
        setattr(engines, _STATE_ATTR, st)
    return st


def _is_vllm(engines: RemoteEngines) -> bool:
    from lichen.sync.vllm_sync import is_vllm

    return is_vllm(engines)


def _post_write_hook(cfg: SyncConfig):
    path = cfg.post_write_path
    if not path:
        return None
    from lichen.plugins import load_function

    return load_function(path, "--custom-update-weight-post-write-path")


def _make_transport(engines: RemoteEngines, cfg: SyncConfig) -> Any:
    transport, mode = cfg.transport, cfg.mode
    if transport == "nccl":
        from lichen.sync.distributed import BroadcastSync

        return BroadcastSync(engines, buffer_size=cfg.buffer_size)
    if transport == "tensor":  # before the first bucket: every engine must map this host's shared memory
        from lichen.sync.tensor_handles import TensorSync
        from lichen.sync.visibility import check_same_host

        check_same_host(engines)
        return TensorSync(engines, buffer_size=cfg.buffer_size)
    if mode not in ("full", "delta"):
        raise NotAvailableYet(
            f"--update-weight-transport {transport} --update-weight-mode {mode} to server engines is not available"
        )
    # lichen.config.sync refuses these flag combinations; a SyncConfig built in code gets the same one line
    disk_dir, local_dir = cfg.disk_dir, cfg.local_dir
    if disk_dir is None:
        raise ConfigError("--update-weight-transport disk needs --update-weight-disk-dir DIR")
    from lichen.sync.visibility import check_dir_visible

    check_dir_visible(engines, disk_dir)  # before the first version is written: every engine must see it
    if mode == "delta":
        from lichen.sync.disk_delta import DeltaSync

        if local_dir is None:
            raise ConfigError("--update-weight-mode delta needs --update-weight-local-checkpoint-dir DIR")
        return DeltaSync(
            engines,
            disk_dir=disk_dir,
            local_dir=local_dir,
            hf_checkpoint=cfg.hf_checkpoint,
            encoding=cfg.delta_encoding,
            checksum_format=cfg.delta_checksum,
            full_interval=cfg.full_interval,
            keep_files=cfg.keep_files,
            post_write_hook=_post_write_hook(cfg),
        )
    from lichen.sync.disk import FullDiskSync

    return FullDiskSync(
        engines,
        disk_dir=disk_dir,
        hf_checkpoint=cfg.hf_checkpoint,
        keep_files=cfg.keep_files,
        post_write_hook=_post_write_hook(cfg),
        buffer_size=cfg.buffer_size,
    )


def _push_to_servers(trainer, cfg: SyncConfig, engines: list, version: int) -> dict:
    t0 = time.perf_counter()
    metrics: dict[str, Any] = {"sync/weight_version": version, f"sync/transport_{cfg.transport}": 1}
    sender = trainer_sender(trainer)  # the trainer's ranks send (--runtime ray), else this process
    for eng in engines:
        try:
            st = _state(eng, cfg)
            transport = st["transport"]
            if sender is not None and hasattr(transport, "push_from"):
                metrics.update(transport.push_from(sender, version, st["dtype"]))
            else:
                metrics.update(transport.push(trainer.named_weights(), version, st["dtype"]))
            versions = eng.weight_versions()
        except EngineError as e:  # the engine's own message, with what the run was doing when it came
            raise SyncError(f"weight sync to version {version} failed: engine {e}") from e
        stale = [(url, v) for url, v in zip(eng.active_urls(), versions) if v != str(version)]
        if stale:
            raise StaleEngineError(
                f"engines {[u for u, _ in stale]} report weight versions {[v for _, v in stale]} "
                f"after the sync to version {version}"
            )
        if hasattr(transport, "verify"):  # the transport's own check (vLLM: the checksums its receiver took)
            metrics.update(transport.verify(eng, version))
            continue
        metrics.update(
            verify_engines(
                eng,
                trainer.named_weights,
                st["dtype"],
                version=version,
                full=cfg.check_all_weights,
                expected=getattr(transport, "sent_checksums", None) or None,
                fetch=_rows_from(sender, st["dtype"]),
            )
        )
    metrics["time/sync"] = time.perf_counter() - t0
    log.debug(
        "weight sync to version %d over %s/%s: %s bytes on the wire, %.3f s",
        version,
        cfg.transport,
        cfg.mode,
        metrics.get("sync/bytes"),
        metrics["time/sync"],
    )
    return metrics


def _rows_from(sender: Any, dtype: Any) -> Any:
    """The sampled check's reader of trainer tensors through the sender (only the tensors it checks), or None."""
    if sender is None:
        return None
    from lichen.weights.wire import dtype_name

    return lambda names, rows: sender.call("rows", names, dtype_name(dtype), rows)


def close(rollout) -> None:
    """Release transport state held for `rollout`'s engines (broadcast groups); safe to call twice, and never
    raises (the run loop calls it in a `finally`, before stopping the engines)."""
    try:
        engines = list(getattr(rollout, "engines", None) or [])
    except Exception as e:
        log.warning("closing the weight transports: %s", e)
        return
    for eng in engines:
        st = getattr(eng, _STATE_ATTR, None)
        if st is not None:
            setattr(eng, _STATE_ATTR, None)
        if st is not None and hasattr(st["transport"], "close"):
            try:
                st["transport"].close()
            except Exception as e:
                log.warning("closing the weight transport: %s", e)
