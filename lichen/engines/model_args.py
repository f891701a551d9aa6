"""`lichen serve`'s model-code flags (--model-impl, --trust-remote-code, --qwen-gdn-backend), the same names and
meanings as `lichen train`'s (lichen/config/model.py), and what a launched server is told of them."""

from __future__ import annotations

import argparse


def add_model_impl_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model-impl",
        choices=["auto", "lichen", "hf"],
        default="auto",
        help="model code: lichen (llama/qwen2/qwen3), hf (the transformers module with its KV cache; "
        "docs/models.md lists what it serves) or auto (lichen's where it has the type; default)",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let transformers run code shipped with the checkpoint (config.json auto_map)",
    )
    p.add_argument(
        "--qwen-gdn-backend",
        choices=["fla", "flashqla", "torch"],
        default=None,
        help="Gated DeltaNet kernel of Qwen3-Next-style models (default: fla with CUDA and fla, else torch)",
    )


def launch_model_args(options: dict | None) -> list[str]:
    """`lichen serve` flags that give a launched server the run's model code (`options`: load_model's impl /
    trust_remote_code / gdn_backend); flags at serve's defaults are left out."""
    options = options or {}
    out = []
    if options.get("impl", "auto") != "auto":
        out += ["--model-impl", options["impl"]]
    if options.get("trust_remote_code"):
        out.append("--trust-remote-code")
    if options.get("gdn_backend"):
        out += ["--qwen-gdn-backend", options["gdn_backend"]]
    return out
