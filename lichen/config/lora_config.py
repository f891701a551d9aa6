"""LoRA's typed configuration (`--use-lora` and the `--lora-*` flags): slime's presets in Hugging Face's module
names, the translation of slime's Megatron-named regexes, and `LoraConfig`, resolved once from the parsed flags.

Target and exclude patterns are regexes matched with `re.search` against module names in Hugging Face's naming
(`model.layers.0.self_attn.q_proj`), which lichen's own models and transformers' modules share, and against the
routed experts' stacked parameter names (`model.layers.1.mlp.experts.gate_up_proj`). slime's presets
and regexes name Megatron modules (`decoder.layers.0.self_attention.linear_qkv`, q/k/v fused); `resolve_patterns`
maps them onto HF names. `LoraConfig.adapted` is the one selection rule: the flag check applies it to the
checkpoint's weight names (the `--dry-run` line), the trainer to its module's names.

Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

from lichen.errors import ConfigError, NotAvailableYet

_LAYER = r"(?:^|\.)layers\.\d+\."
# attention projections; with MLA (DeepSeek-V3) its low-rank q/kv projections too (slime refuses MLA models)
_ATTENTION = (_LAYER + r"self_attn\.(?:q_proj|k_proj|v_proj|o_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)$",)
_DENSE_MLP = (_LAYER + r"mlp\.(?:gate_proj|up_proj|gate_up_proj|down_proj)$",)
# Qwen3-Next's Gated DeltaNet projections (slime: linear_attn.in_proj_qkv/_z/_b/_a, out_proj; HF fuses qkv+z, b+a)
_HYBRID_ATTENTION = _ATTENTION + (_LAYER + r"linear_attn\.(?:in_proj_qkvz|in_proj_ba|out_proj)$",)
# the MoE shared experts are dense MLPs: shared_experts (DeepSeek-V3, GLM-4-MoE), shared_expert (Qwen3-Next)
_SHARED_MLP = (_LAYER + r"mlp\.shared_experts?\.(?:gate_proj|up_proj|down_proj)$",)
# Routed experts: transformers keeps each MoE layer's experts as stacked 3-D parameters of one module
# (`mlp.experts.gate_up_proj` [experts, ...], `mlp.experts.down_proj`), not Linear modules; lichen adapts these
# parameters through peft's `target_parameters` (one rank-r pair per expert; slime shares one pair by all experts).
_ROUTED_EXPERTS = (_LAYER + r"mlp\.experts\.(?:gate_up_proj|down_proj)$",)

# slime's preset names (slime/utils/lora_config.py) -> HF-named regexes; routers, embeddings, the LM head and
# norms are in none of them.
PRESETS: dict[str, tuple[str, ...]] = {
    "dense_attention": _ATTENTION,
    "dense_mlp": _DENSE_MLP,
    "dense_language": _ATTENTION + _DENSE_MLP,
    "hybrid_attention": _HYBRID_ATTENTION,
    "hybrid_language": _HYBRID_ATTENTION + _DENSE_MLP,
    "moe_attention": _ATTENTION,
    "moe_shared_mlp": _SHARED_MLP,
    "moe_routed_experts": _ROUTED_EXPERTS,
    "moe_mlp": _SHARED_MLP + _ROUTED_EXPERTS,
    "moe_language": _ATTENTION + _SHARED_MLP,
    "moe_language_all": _ATTENTION + _SHARED_MLP + _ROUTED_EXPERTS,
}
DEFAULT_PRESET = "dense_language"  # slime's default
# slime's default excludes (embedding, output_layer, visual) in HF names, plus the MoE routers
DEFAULT_EXCLUDES = (
    r"(?:^|\.)embed_tokens$",
    r"(?:^|\.)lm_head$",
    r"(?:^|\.)visual(?:\.|$)",
    r"(?:^|\.)mlp\.(?:gate|router|shared_expert_gate)$",
)

# Megatron name pieces with an HF counterpart, replaced in this order inside a slime regex.
_MEGATRON_TO_HF = (
    (r"decoder\.layers", r"layers"),
    ("decoder.layers", "layers"),
    ("self_attention", "self_attn"),
    ("shared_experts", "shared_experts?"),
    ("linear_qkv", "(?:q_proj|k_proj|v_proj)"),
    ("linear_proj", "o_proj"),
    ("linear_fc1", "(?:gate_proj|up_proj|gate_up_proj)"),
    ("linear_fc2", "down_proj"),
    ("embedding", "embed_tokens"),
    ("output_layer", "lm_head"),
)
# Megatron pieces without one lichen can adapt: a pattern holding one is refused, with the reason. (Routed experts
# translate: `mlp.experts.linear_fc1` -> `mlp.experts.(?:...|gate_up_proj)`, the stacked parameter's name.)
_UNTRANSLATABLE = (
    (
        re.compile(r"linear_q_proj|linear_q_down_proj|linear_q_up_proj|linear_kv_down_proj|linear_kv_up_proj"),
        "Megatron's MLA projections have no one-to-one HF module; name HF's (q_a_proj, q_b_proj, kv_a_proj_with_mqa, "
        "kv_b_proj, o_proj) instead",
    ),
    (
        re.compile(r"in_proj_qkv(?!z)|in_proj_[zab]\b|in_proj_[ab](?!a)"),
        "Megatron splits Gated DeltaNet's input projection differently from HF; name HF's in_proj_qkvz / in_proj_ba",
    ),
)
_MEGATRON_PIECES = re.compile(
    r"decoder|self_attention|linear_qkv|linear_proj|linear_fc[12]|output_layer|"
    r"embedding|linear_q_|linear_kv_|in_proj_qkv(?!z)|in_proj_[zab]\b"
)


def translate_pattern(pattern: str, flag: str) -> str:
    """A regex of `flag` as an HF-named regex: slime's Megatron pieces replaced, HF-named patterns kept as given.
    Raises ConfigError for a piece lichen cannot translate, and for an invalid regex."""
    for piece, reason in _UNTRANSLATABLE:
        if piece.search(pattern):
            raise NotAvailableYet(f"{flag} {pattern!r} cannot be translated to Hugging Face module names: {reason}")
    out = pattern
    if _MEGATRON_PIECES.search(pattern):
        for megatron, hf in _MEGATRON_TO_HF:
            out = out.replace(megatron, hf)
    try:
        re.compile(out)
    except re.error as e:
        raise ConfigError(f"{flag} {pattern!r}: not a valid regular expression ({e})") from None
    return out


def resolve_patterns(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(target regexes, exclude regexes) in HF names from --lora-target-preset / --lora-target-modules /
    --lora-exclude-modules; ConfigError (exit 2) for what cannot be resolved."""
    if args.lora_target_modules and args.lora_target_preset:
        raise ConfigError("--lora-target-modules and --lora-target-preset: give only one of them (slime's rule)")
    if args.lora_target_modules:
        targets = tuple(translate_pattern(p, "--lora-target-modules") for p in args.lora_target_modules)
    else:
        targets = PRESETS[args.lora_target_preset or DEFAULT_PRESET]
    if args.lora_exclude_modules is None:
        excludes = DEFAULT_EXCLUDES
    else:
        excludes = tuple(translate_pattern(p, "--lora-exclude-modules") for p in args.lora_exclude_modules)
    return targets, excludes


# Never adapted, whatever the patterns say: lichen computes logits from the head's (or the tied embedding's)
# weight directly, so an adapter there would train nothing and still change the merged weights the engines get.
NEVER_ADAPTED = re.compile(r"(?:^|\.)(?:lm_head|embed_tokens)$")


@dataclass(frozen=True)
class LoraConfig:
    """What lichen.train.lora needs to wrap the policy, build its optimizer and save its adapters."""

    rank: int
    alpha: float
    targets: tuple[str, ...]  # HF-named regexes (re.search)
    excludes: tuple[str, ...]
    preset: str | None  # None: --lora-target-modules were given
    lr: float  # --lora-learning-rate, else --lr
    weight_decay: float  # --lora-weight-decay (always; --weight-decay does not apply to adapters)
    load: str | None  # --lora-load: an adapter directory to start from
    save_lora: str | None  # --save-lora template ({rollout_id})
    save_merged_hf: str | None  # --lora-save-merged-hf template ({rollout_id})
    sync_mode: str  # "merged": the engines get W + alpha/r * B A as full weights

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def adapted(self, module_names: list[str]) -> list[str]:
        """The names among `module_names` that a target pattern finds and no exclude pattern does, in order."""
        targets = [re.compile(p) for p in self.targets]
        excludes = [re.compile(p) for p in self.excludes]
        return [
            name
            for name in module_names
            if any(t.search(name) for t in targets) and not any(e.search(name) for e in excludes)
        ]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "LoraConfig | None":
        """None without --use-lora; otherwise the resolved flags (lichen.config.lora.check has checked them)."""
        if not args.use_lora:
            return None
        targets, excludes = resolve_patterns(args)
        return cls(
            rank=args.lora_rank,
            alpha=args.lora_alpha,
            targets=targets,
            excludes=excludes,
            preset=None if args.lora_target_modules else args.lora_target_preset or DEFAULT_PRESET,
            lr=args.lora_learning_rate if args.lora_learning_rate is not None else args.lr,
            weight_decay=args.lora_weight_decay,
            load=args.lora_load,
            save_lora=args.save_lora,
            save_merged_hf=args.lora_save_merged_hf,
            sync_mode=args.lora_rollout_sync_mode,
        )
