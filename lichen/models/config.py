"""Model configuration read from a Hugging Face `config.json` (llama, qwen2, qwen3)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from lichen.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
DEFAULT_POSITIONS = 4096  # max_position_embeddings when config.json has none


def model_config_value(model_dir: str, key: str, default: Any = None) -> Any:
    """`key` of `model_dir`/config.json, or `default` when it is absent or not a positive integer; a missing or
    non-JSON config.json also gives `default`, and is left for the model loader to report."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            value = json.load(f).get(key, default)
    except (OSError, ValueError, AttributeError):
        return default
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def model_positions(model_dir: str) -> int:
    """The model's max_position_embeddings (DEFAULT_POSITIONS when config.json has none, as ModelConfig)."""
    return model_config_value(model_dir, "max_position_embeddings", DEFAULT_POSITIONS)


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v (and for llama also o) projections carry a bias
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # qwen3: RMSNorm over each head's q and k
    rope_scaling: dict | None

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "ModelConfig":
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{source}: model_type {model_type!r} is not supported; lichen implements {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        num_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
        rope_scaling = d.get("rope_scaling") or d.get("rope_parameters")
        rope_theta = d.get("rope_theta")
        if rope_theta is None and isinstance(rope_scaling, dict):
            rope_theta = rope_scaling.get("rope_theta")
        if isinstance(rope_scaling, dict) and rope_scaling.get("rope_type", rope_scaling.get("type")) in (
            None,
            "default",
        ):
            rope_scaling = None
        if model_type == "qwen2":  # Qwen2 always has q/k/v biases and no o bias
            attention_bias, o_bias = True, False
        elif model_type == "qwen3":
            attention_bias = o_bias = bool(d.get("attention_bias", False))
        else:
            attention_bias = o_bias = bool(d.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            max_position_embeddings=d.get("max_position_embeddings", DEFAULT_POSITIONS),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_bias=o_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            rope_scaling=rope_scaling,
        )

    @classmethod
    def from_pretrained(cls, model_dir: str) -> "ModelConfig":
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(
                f"no config.json in {model_dir!r}: --hf-checkpoint must be a Hugging Face model directory"
            )
        with open(path) as f:
            return cls.from_dict(json.load(f), source=path)
