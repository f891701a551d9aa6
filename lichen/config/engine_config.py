"""The typed configs of the engine servers, weight sync and the metrics sinks, resolved once from the flags.

`EngineConfig.from_args(args)`, `SyncConfig.from_args(args)` and `ObserveConfig.from_args(args)` read the
resolved argparse namespace as it is (defaults live in argparse only). The components take these instead of
`args`: `RemoteEngines.from_config`, `SGLangLauncher.from_config`, `sync.push(..., cfg)`,
`MetricsLogger.from_config`. An engine config says what the servers are and what they must serve, in the engines'
own terms: which training features need which endpoints is decided here, so the engines know nothing of training.

A leaf: imports nothing of lichen but `errors` (docs/architecture.md#import-directions), and no torch.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, Mapping

from lichen.config.model_code import model_options


def required_endpoints(args: argparse.Namespace) -> dict[str, str]:
    """Endpoint path -> the feature (flag) of this run that needs it on every engine server."""
    need = {"/generate": "rollout", "/model_info": "weight-version checks", "/health": "health checks"}
    if args.update_weight_transport == "disk" and not args.debug_rollout_only:
        for path in ("/pause_generation", "/flush_cache", "/update_weights_from_disk", "/continue_generation"):
            need[path] = "--update-weight-transport disk"
    if args.offload_rollout:
        for path in ("/flush_cache", "/release_memory_occupation", "/resume_memory_occupation"):
            need.setdefault(path, "--offload-rollout")
    if args.use_fault_tolerance:
        need["/health_generate"] = "--use-fault-tolerance"
    return need


@dataclass(frozen=True)
class EngineConfig:
    """The engine servers of a run: launched (`num_engines` > 0) or external (`addresses`)."""

    model_path: str
    num_engines: int  # servers to launch; 0 means use `addresses`
    addresses: tuple[str, ...]
    backend: str  # what to launch: "lichen" (lichen serve) or "sglang"
    log_dir: str | None  # launched servers' logs (<output dir>/engines)
    concurrency: int  # requests in flight per server
    failover: bool  # route around a failed server, monitor health and restart launched ones
    health_interval: float | None
    health_timeout: float | None
    health_first_wait: float | None
    min_healthy: int  # --min-healthy-engines: fewer engines than this left (the others retired) stops the run
    max_failed_restarts: int  # --rollout-max-failed-restarts: failed restarts in a row that retire an engine
    control_file: str | None  # <output dir>/engines.add: engines added while the run goes on (failover only)
    api_key_file: str | None  # external servers' keys (else the environment)
    admin_api_key_file: str | None
    required: Mapping[str, str]  # endpoint path -> the feature that needs it
    # launched servers
    device: str
    model_options: dict  # --model-impl, --trust-remote-code, --qwen-gdn-backend (lichen serve's flags of these names)
    max_batch_size: int | None
    num_threads: int | None
    weight_dir: str | None  # where published weight versions are read from
    local_checkpoint_dir: str | None  # where a server may pull versions to
    max_prompt_len: int | None
    max_response_len: int | None  # the longest response the run asks for (training or eval)
    # launched SGLang servers
    seed: int
    sglang_dtype: str
    gpus_per_engine: int
    memory_saver: bool
    passthrough: tuple[str, ...]  # --sglang-<flag> / --vllm-<flag> tokens
    # launched vLLM servers: the interpreter of vLLM's environment (--vllm-python; None: lichen.engines.clients.vllm_launcher)
    vllm_python: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EngineConfig":
        responses = [n for n in (args.rollout_max_response_len, args.eval_max_response_len) if n]
        return cls(
            model_path=args.hf_checkpoint,
            num_engines=args.rollout_num_engines or 0,
            addresses=tuple(args.rollout_external_engine_addrs or ()),
            backend=args.rollout_engine_backend,
            log_dir=os.path.join(args.output_dir, "engines") if args.output_dir else None,
            concurrency=args.sglang_server_concurrency,
            failover=bool(args.use_fault_tolerance),
            health_interval=args.rollout_health_check_interval,
            health_timeout=args.rollout_health_check_timeout,
            health_first_wait=args.rollout_health_check_first_wait,
            min_healthy=getattr(args, "min_healthy_engines", None) or 1,
            max_failed_restarts=getattr(args, "rollout_max_failed_restarts", None) or 3,
            control_file=os.path.join(args.output_dir, "engines.add") if args.output_dir else None,
            api_key_file=args.rollout_external_engine_api_key_file,
            admin_api_key_file=args.rollout_external_engine_admin_api_key_file,
            required=required_endpoints(args),
            device=args.device,
            model_options=model_options(args),
            max_batch_size=args.rollout_max_batch_size,
            num_threads=args.num_threads,
            weight_dir=args.update_weight_disk_dir,
            local_checkpoint_dir=args.update_weight_local_checkpoint_dir,
            max_prompt_len=args.rollout_max_prompt_len,
            max_response_len=max(responses) if responses else None,
            seed=args.seed,
            sglang_dtype="bfloat16" if args.bf16 else "float32",
            gpus_per_engine=args.rollout_num_gpus_per_engine or 1,
            memory_saver=bool(args.offload_rollout),
            passthrough=tuple(args.sglang_passthrough),
            vllm_python=getattr(args, "vllm_python", None),
        )


@dataclass(frozen=True)
class SyncConfig:
    """How `sync.push` publishes the trainer's weights to engine servers (docs/architecture.md#weight-sync)."""

    transport: str  # nccl | disk
    mode: str  # full | delta
    buffer_size: int  # bytes per broadcast bucket
    disk_dir: str | None
    local_dir: str | None
    hf_checkpoint: str  # config.json and tokenizer files of each full version
    delta_encoding: str
    delta_checksum: str
    full_interval: int  # a full version every N (0: only the first)
    keep_files: bool
    post_write_path: str | None  # plug-in fn(version_dir) run after each version is written
    check_all_weights: bool  # compare every tensor after each sync, not a sample

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "SyncConfig":
        return cls(
            transport=args.update_weight_transport,
            mode=args.update_weight_mode,
            buffer_size=args.update_weight_buffer_size,
            disk_dir=args.update_weight_disk_dir,
            local_dir=args.update_weight_local_checkpoint_dir,
            hf_checkpoint=args.hf_checkpoint,
            delta_encoding=args.update_weight_delta_encoding,
            delta_checksum=args.update_weight_delta_checksum,
            full_interval=args.update_weight_full_interval or 0,
            keep_files=bool(args.update_weight_disk_keep_files),
            post_write_path=args.custom_update_weight_post_write_path,
            check_all_weights=bool(args.check_weight_update_equal),
        )


@dataclass(frozen=True)
class ObserveConfig:
    """Where metrics go: metrics.jsonl under `output_dir`, TensorBoard, W&B; and what else the run records."""

    output_dir: str
    use_tensorboard: bool
    use_wandb: bool
    wandb_mode: str
    wandb_project: str
    wandb_run_name: str | None
    wandb_key: str | None
    run_config: Mapping[str, Any]  # the resolved flags, recorded with the run
    # lichen.observe.run_observer: the sample log, the trace, the hang watchdog (lichen train only: `lichen eval`
    # has no such flags, so they are off there)
    log_samples: int = 0
    trace: bool = False
    watchdog_timeout: float = 0.0  # seconds; 0: off
    watchdog_wait: bool = False
    wandb_group: str | None = None  # lichen eval has no --wandb-group
    reward_key: str | None = None  # which entry of a dict reward the sample log shows

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ObserveConfig":
        return cls(
            output_dir=args.output_dir,
            use_tensorboard=bool(args.use_tensorboard),
            use_wandb=bool(args.use_wandb),
            wandb_mode=args.wandb_mode,
            wandb_project=args.wandb_project,
            wandb_run_name=args.wandb_run_name,
            wandb_key=args.wandb_key,
            wandb_group=getattr(args, "wandb_group", None),
            run_config=dict(vars(args)),
            log_samples=int(getattr(args, "log_samples", 0) or 0),
            trace=bool(getattr(args, "trace", False)),
            watchdog_timeout=float(getattr(args, "watchdog_timeout", 0) or 0),
            watchdog_wait=bool(getattr(args, "watchdog_wait", False)),
            reward_key=getattr(args, "reward_key", None),
        )


@dataclass(frozen=True)
class FrozenModelSpec:
    """One frozen model of --sglang-config: its name, HF checkpoint and engine servers."""

    name: str
    model_path: str
    num_engines: int
    gpus_per_engine: int = 1
