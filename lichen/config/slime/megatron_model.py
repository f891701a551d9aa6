"""The "checked" class: Megatron model-architecture flags compared with the HF config.json lichen loads.

Megatron builds the model from flags, lichen from `--hf-checkpoint`'s config.json, so in a slime script the flags
describe a model that config.json already defines. Comparing them catches a wrong `--hf-checkpoint`. Fields that
define weight shapes must agree (a disagreement stops the run, naming both values); the others (positions, rope
base, norm epsilon, ...) may be spelled or rounded differently and only warn.
"""

from __future__ import annotations

import math
from typing import Any, Callable

# A field is config.json's key, or (the name shown, a function of the whole config; None: not defined here).
Field = str | tuple[str, Callable[[dict], Any]]


def _head_dim(c: dict) -> Any:
    if c.get("head_dim"):
        return c["head_dim"]
    heads = c.get("num_attention_heads")
    return c["hidden_size"] // heads if heads and c.get("hidden_size") else None


def _shared_expert(c: dict) -> Any:
    if "shared_expert_intermediate_size" in c:
        return c["shared_expert_intermediate_size"]
    if c.get("n_shared_experts") and c.get("moe_intermediate_size"):  # deepseek / glm4_moe spelling
        return c["n_shared_experts"] * c["moe_intermediate_size"]
    return None


def _rope_theta(c: dict) -> Any:
    if "rope_theta" in c:
        return c["rope_theta"]
    return (c.get("rope_parameters") or {}).get("rope_theta")


def _rope_scaling(key: str) -> Callable[[dict], Any]:
    """A field of config.json's rope scaling (`rope_scaling`, or `rope_parameters` in newer transformers)."""

    def read(c: dict) -> Any:
        scaling = c.get("rope_scaling") or c.get("rope_parameters") or {}
        return scaling.get(key) if isinstance(scaling, dict) else None

    return read


def _uses_rope_scaling(c: dict) -> Any:
    scaling = c.get("rope_scaling") or c.get("rope_parameters")
    if not isinstance(scaling, dict):
        return False if "rope_scaling" in c else None
    return scaling.get("rope_type", scaling.get("type", "default")) != "default"


_ROUTED_EXPERTS = "n_routed_experts"
_LOCAL_EXPERTS = "num_local_experts"
# flag -> (default field, {model_type: field}); every one of these defines a weight shape.
SHAPE_FIELDS: dict[str, tuple[Field, dict[str, Field]]] = {
    "--num-layers": ("num_hidden_layers", {}),
    "--hidden-size": ("hidden_size", {}),
    "--ffn-hidden-size": ("intermediate_size", {}),
    "--num-attention-heads": ("num_attention_heads", {}),
    "--num-query-groups": (
        ("num_key_value_heads", lambda c: c.get("num_key_value_heads", c.get("num_attention_heads"))),
        {},
    ),
    "--kv-channels": (("head_dim", _head_dim), {}),
    # Megatron pads --vocab-size to a multiple of its TP size internally; the flag itself is the unpadded size
    "--vocab-size": ("vocab_size", {}),
    "--num-experts": (
        "num_experts",
        {
            "gpt_oss": _LOCAL_EXPERTS,
            "mixtral": _LOCAL_EXPERTS,
            "minimax_m2": _LOCAL_EXPERTS,
            "deepseek_v3": _ROUTED_EXPERTS,
            # Kimi-K2's remote-code config is DeepSeek-V3's; GLM-5's transformers config names it the same way
            "kimi_k2": _ROUTED_EXPERTS,
            "glm4_moe": _ROUTED_EXPERTS,
            "glm4_moe_lite": _ROUTED_EXPERTS,
            "glm_moe_dsa": _ROUTED_EXPERTS,
        },
    ),
    "--moe-ffn-hidden-size": (
        "moe_intermediate_size",
        {"gpt_oss": "intermediate_size", "mixtral": "intermediate_size", "minimax_m2": "intermediate_size"},
    ),
    "--moe-shared-expert-intermediate-size": (("shared expert size", _shared_expert), {}),
    "--q-lora-rank": ("q_lora_rank", {}),
    "--kv-lora-rank": ("kv_lora_rank", {}),
    "--qk-head-dim": ("qk_nope_head_dim", {}),
    "--qk-pos-emb-head-dim": ("qk_rope_head_dim", {}),
    "--v-head-dim": ("v_head_dim", {}),
    "--mtp-num-layers": ("num_nextn_predict_layers", {}),
}
# flag -> (field, {model_type: field}); a disagreement is a warning.
WARN_FIELDS: dict[str, tuple[Field, dict[str, Field]]] = {
    "--moe-router-topk": ("num_experts_per_tok", {}),
    "--max-position-embeddings": ("max_position_embeddings", {}),
    "--rotary-base": (("rope_theta", _rope_theta), {}),
    "--norm-epsilon": ("rms_norm_eps", {}),
    "--rotary-percent": (("partial_rotary_factor", lambda c: c.get("partial_rotary_factor", 1.0)), {}),
    "--untie-embeddings-and-output-weights": (
        ("not tie_word_embeddings", lambda c: not c.get("tie_word_embeddings", False)),
        {},
    ),
    "--moe-router-group-topk": ("topk_group", {}),
    "--moe-router-num-groups": ("n_group", {}),
    "--use-rope-scaling": (("rope_scaling (a scaled rope type)", _uses_rope_scaling), {}),
    "--rope-scaling-factor": (("rope_scaling.factor", _rope_scaling("factor")), {}),
    "--rotary-scaling-factor": (("rope_scaling.factor", _rope_scaling("factor")), {}),
    "--mscale": (("rope_scaling.mscale", _rope_scaling("mscale")), {}),
    "--mscale-all-dim": (("rope_scaling.mscale_all_dim", _rope_scaling("mscale_all_dim")), {}),
    "--activation-func-clamp-value": ("swiglu_limit", {}),
    # Megatron's "W,0" is (left window, right window); config.json holds the left one
    "--window-size": ("sliding_window", {}),
}
# a flag whose value is spelled differently from the config.json field: the part that is compared
_FLAG_VALUE: dict[str, Callable[[str], str]] = {"--window-size": lambda v: v.split(",")[0].strip("() ")}


def _field_value(spec: Field, config: dict) -> tuple[str, Any]:
    if isinstance(spec, tuple):
        return spec[0], spec[1](config)
    return spec, config.get(spec)


def _same(flag_value: Any, hf_value: Any) -> bool:
    if isinstance(hf_value, bool) or isinstance(flag_value, bool):
        return bool(flag_value) == bool(hf_value)
    try:
        a, b = float(flag_value), float(hf_value)
    except (TypeError, ValueError):
        return str(flag_value) == str(hf_value)
    return math.isclose(a, b, rel_tol=1e-9)


def check_flag(flag: str, values: list[str], config: dict, hf_dir: str) -> tuple[str, bool]:
    """(what the comparison found, whether it stops the run) for one Megatron model flag."""
    model_type = config.get("model_type")
    shape = flag in SHAPE_FIELDS
    table = SHAPE_FIELDS if shape else WARN_FIELDS
    if flag not in table:
        if flag == "--moe-layer-freq":
            return "warning: not compared (a Megatron expression; config.json's layer types decide)", False
        return f"describes the architecture; config.json (model_type {model_type!r}) defines it", False
    default, per_type = table[flag]
    name, hf_value = _field_value(per_type.get(model_type, default), config)
    where = f"{hf_dir}/config.json {name}"
    given: Any = values[0] if values else True  # an on/off flag given means true
    if values and flag in _FLAG_VALUE:
        given = _FLAG_VALUE[flag](values[0])
    if hf_value is None:
        return f"warning: {where} has no such field for model_type {model_type!r}; not compared", False
    if _same(given, hf_value):
        return f"matches {where} = {hf_value}", False
    if shape:
        return (
            f"{flag} {given} but {where} = {hf_value}: a weight shape differs; is --hf-checkpoint the model "
            "this script was written for?"
        ), True
    return f"warning: {flag} {given} but {where} = {hf_value}", False
