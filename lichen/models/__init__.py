"""Per-architecture model code shared by trainer and engine (docs/architecture.md#shared-model-code)."""

from __future__ import annotations

from typing import Any

from lichen.models.config import ModelConfig


def __getattr__(name: str) -> Any:
    # torch loads on first use of the model code, so `lichen train --dry-run` reads config.json without it
    if name in ("CausalLM", "KVCache"):
        from lichen.models import transformer

        return getattr(transformer, name)
    if name == "load_model":
        from lichen.models.loading import load_model

        return load_model
    raise AttributeError(f"module 'lichen.models' has no attribute {name!r}")


__all__ = ["CausalLM", "KVCache", "ModelConfig", "load_model"]
