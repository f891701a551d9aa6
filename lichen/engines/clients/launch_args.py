"""What the engine servers lichen starts are told, and the keys of the ones it connects to.

`launch_server_args` builds the `lichen serve` flags of launched engines from an EngineConfig (device, threads,
the run's weight directories, queue bounds); `external_keys` reads the keys of external servers from key files
or the environment, never from the command line (docs/serving.md).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from lichen.engines.api.auth import ENGINE_ADMIN_KEY_ENV, ENGINE_KEY_ENV
from lichen.engines.api.model_args import launch_model_args
from lichen.key_files import resolve_key

if TYPE_CHECKING:
    from lichen.config.engine_config import EngineConfig


def launch_server_args(cfg: EngineConfig) -> list[str]:
    """`lichen serve` flags for launched engines (`cfg` an EngineConfig): the trainer's device and dtype (float32,
    as the in-process engine) and model code (--model-impl and friends), the batch cap, the CPU threads split between the engines, the run's weight
    directories (the only ones the engines may read weights from and pull to) and work bounds sized from the run."""
    out = [
        "--device",
        str(cfg.device or "auto"),
        "--dtype",
        "float32",
        *launch_model_args(getattr(cfg, "model_options", None)),
    ]
    if cfg.max_batch_size:
        out += ["--max-batch-size", str(cfg.max_batch_size)]
    threads = cfg.num_threads or max(1, (os.cpu_count() or 1) // cfg.num_engines)
    out += ["--num-threads", str(threads)]
    if cfg.weight_dir:
        out += ["--weight-dir", os.path.abspath(cfg.weight_dir)]
    if cfg.local_checkpoint_dir:
        out += ["--local-checkpoint-dir", os.path.abspath(cfg.local_checkpoint_dir)]
    return out + launch_limits(cfg)


def launch_limits(cfg: EngineConfig) -> list[str]:
    """Queue bounds for launched engines: the client keeps at most `cfg.concurrency` requests of one sequence
    each in flight per engine, so twice that (at least `lichen serve`'s default) leaves room for eval and control
    traffic; tokens: that many sequences of the run's longest prompt + response, and request bodies sized for one
    such sequence (`request_bytes`), when both are set (else `lichen serve`'s defaults)."""
    from lichen.engines.api.limit_defaults import DEFAULT_MAX_QUEUED_SEQUENCES

    seqs = max(DEFAULT_MAX_QUEUED_SEQUENCES, 2 * int(cfg.concurrency))
    out = ["--max-queued-sequences", str(seqs)]
    if cfg.max_prompt_len and cfg.max_response_len:
        tokens = int(cfg.max_prompt_len) + int(cfg.max_response_len)
        out += ["--max-queued-tokens", str(seqs * tokens)]
        out += ["--max-request-bytes", str(request_bytes(tokens))]
    return out


def request_bytes(tokens: int) -> int:
    """The largest body a run's requests need: one sequence of `tokens` tokens (lichen's client sends the
    prompt, or prompt + partial response, as input_ids: at most 9 bytes a token in JSON) or the same as chat
    text (~4 bytes a token, up to 6 when JSON escapes it), with tools and settings around it. 64 bytes a token
    covers all of these; never under 4 MiB, so eval, tool schemas and control calls have room."""
    return max(MIN_REQUEST_BYTES, 64 * tokens)


MIN_REQUEST_BYTES = 4 * 1024 * 1024


def external_keys(cfg: EngineConfig) -> tuple[str | None, str | None]:
    """(API key, admin key) of external servers: from the key files (`cfg.api_key_file`, `cfg.admin_api_key_file`)
    or the environment (LICHEN_ENGINE_API_KEY, LICHEN_ENGINE_ADMIN_API_KEY), never from the command line."""
    api = resolve_key(
        flag_value=None,
        file_path=cfg.api_key_file,
        env=ENGINE_KEY_ENV,
        flag="",
        file_flag="--rollout-external-engine-api-key-file",
    )
    admin = resolve_key(
        flag_value=None,
        file_path=cfg.admin_api_key_file,
        env=ENGINE_ADMIN_KEY_ENV,
        flag="",
        file_flag="--rollout-external-engine-admin-api-key-file",
    )
    return api, admin
