"""Tiny random checkpoints of architectures lichen does not implement itself, built through transformers.

`lichen make-tiny-model --arch NAME` writes these with the same character tokenizer and ChatML template as
lichen's own architectures (lichen.models.tiny). The config is built with transformers' config class for the
model type; the parameter count is computed on the meta device (no storage is allocated) and the module is
only instantiated for real when that count is below MAX_TINY_PARAMETERS. Why: composite configs take their
sizes from nested sub-configs and ignore top-level ones, so "tiny" keyword arguments can still describe a
multi-billion-parameter model (one such probe was OOM-killed).

Weights come from the module's own `_init_weights` under `torch.manual_seed(seed)` (in a forked RNG, so the
caller's random state is untouched) and are written with `save_pretrained`: the checkpoint layout is the one
transformers writes for that model type (e.g. per-expert MoE tensors), so `from_pretrained` loads it.
"""

from __future__ import annotations

import os
from typing import Any

from lichen.errors import ConfigError

MAX_TINY_PARAMETERS = 10_000_000

# arch -> (model_type, extra config fields). Expert counts, ranks and widths are the smallest that still use every
# code path: several experts with top-2 routing, a dense first layer where the model has one, shared experts,
# MLA's low-rank q/kv, Qwen3-Next's linear-attention layers next to a full-attention one, gpt-oss's sliding window.
HF_ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        ),
    ),
    "glm4": ("glm4", dict(partial_rotary_factor=0.5, attention_bias=True)),
    "glm4_moe": (
        "glm4_moe",
        dict(
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            partial_rotary_factor=0.5,
            use_qk_norm=True,
        ),
    ),
    "gpt_oss": (
        "gpt_oss",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=16,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
    "qwen3_next": (
        "qwen3_next",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            full_attention_interval=2,
        ),
    ),
    "deepseek_v3": (
        "deepseek_v3",
        dict(
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            v_head_dim=16,
            rope_interleave=True,
        ),
    ),
}


def hf_config(
    arch: str,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
    tie_word_embeddings: bool,
    rope_theta: float,
    rms_norm_eps: float,
    init_std: float,
    vocab_size: int,
    pad_id: int,
    eos_id: int,
) -> Any:
    """The transformers config object of a tiny `arch` model (nothing is allocated)."""
    from transformers import AutoConfig

    model_type, extra = HF_ARCHS[arch]
    head_dim = hidden_size // num_heads
    fields: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        initializer_range=init_std,
        rms_norm_eps=rms_norm_eps,
        rope_theta=rope_theta,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        attention_dropout=0.0,
        use_cache=True,
        torch_dtype="float32",
        **extra,
    )
    if model_type == "deepseek_v3":  # MLA: the rotary part of each head has its own width, which head_dim names
        fields["qk_rope_head_dim"] = fields["head_dim"] = head_dim // 2
        fields["qk_nope_head_dim"] = head_dim // 2
        fields["v_head_dim"] = head_dim
        fields["num_key_value_heads"] = num_heads  # MLA has no grouped kv heads; fewer breaks masked attention
    if model_type == "gpt_oss":
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta}
        fields["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    if model_type == "qwen3_next":
        fields["layer_types"] = [
            "full_attention" if (i + 1) % 2 == 0 else "linear_attention" for i in range(num_layers)
        ]
    return AutoConfig.for_model(model_type, **fields)


def count_hf_parameters(config: Any) -> int:
    """Parameters of the module `config` describes, counted on the meta device (no storage allocated; tied
    embeddings counted once)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def write_hf_weights(config: Any, out_dir: str, seed: int) -> int:
    """Instantiate the module of `config` (refused at >= MAX_TINY_PARAMETERS), initialise it from `seed` and write
    config.json + model.safetensors with `save_pretrained`. Returns the parameter count."""
    import torch
    from transformers import AutoModelForCausalLM

    n = count_hf_parameters(config)
    if n >= MAX_TINY_PARAMETERS:
        raise ConfigError(
            f"--arch {config.model_type}: these sizes give {n:,} parameters (limit {MAX_TINY_PARAMETERS:,} for a "
            "tiny model); pass smaller --hidden-size / --num-layers / --intermediate-size"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    os.chmod(os.path.join(out_dir, "model.safetensors"), 0o644)
    return n
