"""Which code runs the model: --model-impl, --trust-remote-code and --qwen-gdn-backend.

One definition of the three flags for `lichen train` (trainer and in-process engine) and `lichen serve` (the same
names and meanings), and one place that turns them into load_model's keyword arguments. A typed config: every part
may import it; it imports nothing of lichen.
"""

from __future__ import annotations

import argparse
from typing import Protocol


def add_model_code_args(g: "argparse._ActionsContainer") -> None:
    """--qwen-gdn-backend, --model-impl, --trust-remote-code: which code runs the model. One definition for
    `lichen train` (trainer and in-process engine) and `lichen serve` (the same names and meanings)."""
    g.add_argument(
        "--qwen-gdn-backend",
        choices=["fla", "flashqla", "torch"],
        default=None,
        help="kernel for the Gated DeltaNet (linear-attention) layers of Qwen3-Next-style models on the generic HF "
        "path: fla (flash-linear-attention, CUDA), flashqla (QwenLM/FlashQLA, SM90+; lichen does not bind it yet), "
        "torch (transformers' reference chunked/recurrent code, runs on CPU; lichen's addition). Default: fla where "
        "CUDA and the fla package are present, else torch (logged). slime's default is fla",
    )
    g.add_argument(
        "--model-impl",
        choices=["auto", "lichen", "hf"],
        default="auto",
        help="model code for trainer and lichen's engines: lichen (its own llama/qwen2/qwen3, the fast path), hf "
        "(the generic path: the transformers AutoModelForCausalLM module, generating with transformers' KV cache; "
        "docs/models.md) or auto (lichen's where it has the type, else hf; logged) (default: auto)",
    )
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let transformers run code shipped with the checkpoint (config.json auto_map) for model types it does "
        "not have; off: such a checkpoint is refused (default: off)",
    )


class ModelCodeFlags(Protocol):
    """What model_options reads: lichen train's / lichen serve's namespace, or a typed config with the same fields."""

    @property
    def model_impl(self) -> str: ...
    @property
    def trust_remote_code(self) -> bool: ...
    @property
    def qwen_gdn_backend(self) -> str | None: ...


def model_options(args: ModelCodeFlags) -> dict:
    """load_model's keyword arguments from the resolved model-code flags (lichen train's or lichen serve's)."""
    return {
        "impl": args.model_impl,
        "trust_remote_code": bool(args.trust_remote_code),
        "gdn_backend": args.qwen_gdn_backend,
    }
