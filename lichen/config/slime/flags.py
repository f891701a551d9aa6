"""What lichen does with each slime / Megatron-LM flag it does not define itself: one table, data only.

A slime launch script mixes slime's own flags (most of which lichen defines with the same name and meaning) with
Megatron-LM's model, parallelism, fusion and optimizer flags. Every such flag lichen knows of has one row here;
`lichen.config.slime.compat` reads the table, `docs/slime-compat.md` explains the classes. The lichen flags that
keep slime's name but differ in meaning or default are listed in `DIFFERS`.
"""

from __future__ import annotations

# the classes live in slime_flags_data (shared with slime_parser_flags); importers read them from here too
from lichen.config.slime.flags_data import (  # noqa: F401
    BLOCKING,
    CHECKED,
    CLASSES,
    DIFFERS_CLASS,
    MAPPED,
    NA_NO_EFFECT,
    NA_SHARDING,
    NOT_YET,
    REMOVED,
    SAME,
    UNKNOWN,
    FlagRule,
)
from lichen.config.slime.flags_data import rules as _rules
from lichen.config.slime.parser_flags import SLIME_PARSER_FLAGS

_SHARDING_INSTEAD = "FSDP2 over all trainer ranks (one rank in the local runtime)"
_SHAPE = "memory layout only: lichen shards with FSDP2, the numbers do not change"

# Megatron model-architecture flags: compared with the --hf-checkpoint config.json (lichen.config.slime.megatron_model).
CHECKED_FLAGS = (
    "--num-layers",
    "--hidden-size",
    "--ffn-hidden-size",
    "--num-attention-heads",
    "--num-query-groups",
    "--kv-channels",
    "--vocab-size",
    "--num-experts",
    "--moe-ffn-hidden-size",
    "--moe-shared-expert-intermediate-size",
    "--q-lora-rank",
    "--kv-lora-rank",
    "--qk-head-dim",
    "--qk-pos-emb-head-dim",
    "--v-head-dim",
    "--mtp-num-layers",
    "--moe-router-topk",
    "--max-position-embeddings",
    "--rotary-base",
    "--norm-epsilon",
    "--rotary-percent",
    "--untie-embeddings-and-output-weights",
    "--add-qkv-bias",
    "--qk-layernorm",
    "--swiglu",
    "--normalization",
    "--moe-layer-freq",
    "--group-query-attention",
    "--use-rotary-position-embeddings",
    "--position-embedding-type",
    "--disable-bias-linear",
    "--post-self-attn-layernorm",
    "--post-mlp-layernorm",
    "--rotary-interleaved",
    "--spec",
    "--multi-latent-attention",
    "--moe-router-score-function",
    "--moe-router-pre-softmax",
    "--moe-router-enable-expert-bias",
    "--moe-router-topk-scaling-factor",
    "--moe-router-bias-update-rate",
    "--moe-router-load-balancing-type",
    "--init-method-std",
    # compared with a config.json field where one exists (megatron_model.WARN_FIELDS): rope scaling (llama3 /
    # yarn), DeepSeek's grouped routing, gpt-oss's sliding window and SwiGLU clamp
    "--moe-router-group-topk",
    "--moe-router-num-groups",
    "--use-rope-scaling",
    "--rope-scaling-factor",
    "--rotary-scaling-factor",
    "--mscale",
    "--mscale-all-dim",
    "--activation-func-clamp-value",
    "--window-size",
    # described by config.json's model_type (its HF module implements them): gpt-oss's learnable softmax
    # (attention sinks), quick GeGLU with its +1 offset and every-other-layer windows; qwen3-next's gated
    # attention; Megatron's 1+w layer norm, a model without position embeddings, qwen2-moe's shared-expert gate
    "--softmax-type",
    "--quick-geglu",
    "--glu-linear-offset",
    "--window-attn-skip-freq",
    "--attention-output-gate",
    "--use-gated-attention",
    "--apply-layernorm-1p",
    "--no-position-embedding",
    "--moe-shared-expert-gate",
)

SLIME_FLAGS: dict[str, FlagRule] = {
    **SLIME_PARSER_FLAGS,
    **_rules(
        CHECKED,
        "config.json of --hf-checkpoint",
        "Megatron builds the model from flags; lichen reads config.json, so the flag is compared with it",
        *CHECKED_FLAGS,
    ),
    **_rules(
        NA_SHARDING,
        _SHARDING_INSTEAD,
        _SHAPE,
        "--tensor-model-parallel-size",
        "--pipeline-model-parallel-size",
        "--context-parallel-size",
        "--expert-model-parallel-size",
        "--expert-tensor-parallel-size",
        "--sequence-parallel",
        "--decoder-first-pipeline-num-layers",
        "--decoder-last-pipeline-num-layers",
        "--num-layers-per-virtual-pipeline-stage",
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
        "--seq-length",
    ),
    **_rules(
        NA_SHARDING,
        "gradient checkpointing of every layer (--gradient-checkpointing)",
        "which layers Megatron recomputes changes memory, not the result",
        "--recompute-method",
        "--recompute-num-layers",
    ),
    **_rules(
        NA_SHARDING,
        "the local runtime: one process, engines by --colocate / --rollout-num-engines",
        "Ray placement of slime's actors",
        "--num-gpus-per-node",
        "--critic-num-nodes",
        "--critic-num-gpus-per-node",
    ),
    **_rules(
        NA_NO_EFFECT,
        "ignored",
        "a Megatron kernel choice or fusion switch; the math is the same",
        "--no-rope-fusion",
        "--no-masked-softmax-fusion",
        "--no-gradient-accumulation-fusion",
        "--no-bias-swiglu-fusion",
        "--no-bias-dropout-fusion",
        "--no-bias-gelu-fusion",
        "--use-mcore-models",
        "--attention-backend",
        "--transformer-impl",
        "--moe-grouped-gemm",
        "--moe-permute-fusion",
        "--moe-token-dispatcher-type",
        "--moe-enable-deepep",
        "--moe-router-dtype",
        "--moe-token-drop-policy",
        "--attention-softmax-in-fp32",
        "--accumulate-allreduce-grads-in-fp32",
        "--cross-entropy-loss-fusion",
        "--cross-entropy-fusion-impl",
        "--log-interval",
        "--timing-log-level",
        "--log-throughput",
    ),
    **_rules(
        NA_NO_EFFECT,
        "ignored",
        "Megatron's attention kernel, mask layout, memory housekeeping, process "
        "group or logging setting; the math is the same",
        "--use-flash-attn",
        "--qkv-format",
        "--no-create-attention-mask-in-dataloader",
        "--manual-gc",
        "--manual-gc-interval",
        "--empty-unused-memory-level",
        "--distributed-backend",
        "--distributed-timeout-minutes",
        "--data-cache-path",
        "--log-params-norm",
        "--use-legacy-models",
    ),
    **_rules(
        NA_NO_EFFECT,
        "the tokenizer of --hf-checkpoint",
        "slime tokenizes with the --hf-checkpoint tokenizer too; Megatron's own tokenizer settings are unused",
        "--tokenizer-type",
        "--tokenizer-model",
    ),
    **_rules(
        NA_NO_EFFECT,
        "config.json's vocabulary size",
        "Megatron pads the embedding for its tensor parallelism; the padded rows are never used",
        "--make-vocab-size-divisible-by",
    ),
    **_rules(
        NA_NO_EFFECT,
        "lichen's checkpoint format (HF weights + optimizer state)",
        "Megatron's checkpoint file format",
        "--ckpt-format",
    ),
    **_rules(NOT_YET, "--bf16 (or float32, the default)", "fp16 training (loss scaling) is not built", "--fp16"),
    **_rules(
        NA_NO_EFFECT,
        "no dropout (lichen's models have none)",
        "0.0 is the only value lichen runs; another value is refused",
        "--attention-dropout",
        "--hidden-dropout",
    ),
    **_rules(
        NA_SHARDING,
        "adapters on every selected module (one rank holds whole weights)",
        "slime's exceptions for tensor-parallel-replicated modules; lichen has no tensor parallelism",
        "--lora-allow-replicated-modules",
    ),
    **_rules(
        NA_NO_EFFECT, "ignored", "slime's per-step LoRA gradient diagnostics; the training is the same", "--lora-debug"
    ),
    **_rules(MAPPED, "--gradient-checkpointing", "Megatron's activation recompute", "--recompute-granularity"),
    **_rules(
        MAPPED,
        "AdamW (lichen's only optimizer); adam is accepted, others refused",
        "Megatron's adam is AdamW with decoupled weight decay",
        "--optimizer",
    ),
    **_rules(MAPPED, "--wandb-run-name", "slime's name for the W&B run name", "--wandb-exp-name"),
    **_rules(
        MAPPED,
        "lichen's one attention implementation (torch scaled_dot_product_attention)",
        "the FSDP backend's HF attention choice; the result is the same",
        "--attn-implementation",
    ),
    **_rules(
        MAPPED,
        "nothing to balance: one trainer rank holds the whole global batch",
        "balances tokens across data-parallel ranks",
        "--balance-data",
    ),
    **_rules(
        NA_NO_EFFECT,
        "ignored (lichen's --optimizer-cpu-offload copies per FSDP2 unit)",
        "overlaps Megatron's host-device copies of its CPU optimizer step: a speed choice, the math is the same",
        "--overlap-cpu-optimizer-d2h-h2d",
    ),
    **_rules(
        NA_NO_EFFECT,
        "lichen's AdamW, float32 master weights, gradients and moments",
        "lets Megatron keep optimizer state in the dtypes of --main-grads-dtype / --main-params-dtype / "
        "--exp-avg-dtype / --exp-avg-sq-dtype, float32 unless given (those are refused): the math is the same",
        "--use-precision-aware-optimizer",
    ),
    **_rules(
        NOT_YET,
        "train without the MTP head",
        "multi-token-prediction training is not built",
        "--enable-mtp-training",
        "--mtp-loss-scaling-factor",
    ),
    **_rules(
        NOT_YET,
        "--bf16",
        "fp8 / int4 training paths are not built",
        "--fp8-format",
        "--fp8-recipe",
        "--fp8-param-gather",
    ),
    **_rules(
        NOT_YET,
        "--moe-aux-loss-coeff (the load-balancing loss) only",
        "Megatron's router z-loss is not built",
        "--moe-z-loss-coeff",
    ),
}

# A "did you mean" hint for an unknown flag only from this similarity on (difflib's ratio): a typo of a lichen
# flag scores 0.95 and more, while a Megatron name that is not in the table scored 0.6-0.85 against unrelated
# lichen flags (--use-flash-attn -> --use-lora, --no-load-optim -> --no-offload-train, --fp16 -> --bf16).
HINT_CUTOFF = 0.88

# slime's Ray placement flags are lichen's too, for --runtime ray; with the local runtime (one process) they
# place nothing, so a slime script keeps running there with them listed as not applicable.
RAY_PLACEMENT = ("--actor-num-nodes", "--actor-num-gpus-per-node", "--rollout-num-gpus")
RAY_PLACEMENT_LOCAL = FlagRule(
    NA_SHARDING,
    "the local runtime: one process, engines by --colocate / --rollout-num-engines",
    "Ray placement of slime's actors; with --runtime ray they place lichen's actors the same way",
)

# Values of a lichen flag that slime spells differently: flag -> {slime value: lichen value}.
VALUE_ALIASES: dict[str, dict[str, str]] = {
    # slime's FSDP backend (removed in its PR #1664) is what lichen's torch backend is
    "--train-backend": {"fsdp": "torch"},
}

# slime's entry points: train.py is lichen train; train_async.py overlaps rollout and training.
ENTRY_POINTS: dict[str, FlagRule] = {
    "train.py": FlagRule(SAME, "lichen train", "the synchronous RL loop"),
    "train_async.py": FlagRule(MAPPED, "lichen train --async", "rollout of step k+1 overlaps training on step k"),
}

# lichen flags with slime's name whose meaning differs from slime's when given (class "differs"); each is pinned
# by tests/test_slime_differences.py. Aligned with slime since they were listed here: --offload (wins over an
# explicit --no-offload-x), pass@k (reward == 1, k = 1, 2, 4, ... <= n), whitening (sample variance), the value
# loss (no 0.5 factor), norm weights and biases (not decayed), the warm-up ramp (Megatron's k / warm-up steps),
# math/deepscaler (\boxed only; lenient grading is math_lenient / deepscaler_lenient), gpqa letters (A-J) and
# labels, dapo's 300-character window.
DIFFERS: dict[str, str] = {
    "--train-env-vars": "with --runtime local also reaches the engines lichen launches (slime: training actors "
    "only, as lichen's --runtime ray)",
    "--colocate": "with --runtime local the trainer and the engines share the one device with or without "
    "--colocate, which only turns the offloads on; --runtime ray lays bundles out as slime",
    **{
        flag: "names Hugging Face modules: slime's presets mapped, its Megatron regexes translated where one HF "
        "module matches, routed experts adapted as stacked parameters with one adapter per expert (slime: one shared "
        "by all experts), MLA projections adapted (docs/lora.md#targets)"
        for flag in ("--lora-target-preset", "--lora-target-modules", "--lora-exclude-modules")
    },
    "--moe-aux-loss-coeff": "when > 0, weighs the transformers module's own load-balancing loss (router statistics "
    "pooled over all MoE layers, ~top-k when balanced; Megatron sums per-layer losses normalised by top-k, ~1 per "
    "layer), on the HF path, for MoE types whose module defines one; ignored with a warning elsewhere "
    "(docs/models.md#moe)",
    "--debug-train-only": "lichen: training on replayed rollout dumps only, which needs --load-debug-rollout-data "
    "(then it is slime's meaning); slime also trains without engines from a rollout function that generates nothing "
    "(its SFT script: with slime's SFT rollout the flag is left out, lichen's SFT rollout generates nothing)",
    "--load-forge-rollout-data": "replays training rollouts as slime (one file, or a {rollout_id} template falling "
    "back to step 0's file; engines, sync and offload live), but evaluation generates with the live engines "
    "(slime replays eval_<id> files) and the flag alone selects the replay (slime also needs --rollout-function-path "
    "slime.rollout.forge_load.generate_rollout, accepted)",
    **{
        flag: "the policy's parameters only (slime's provider also freezes the PPO critic's); a pattern that "
        "matches no parameter stops the run (slime: silently none); with --use-lora the names are the adapters' "
        "(slime matches Megatron names before its LoRA wrapping)"
        for flag in ("--only-train-params-name-list", "--freeze-params-name-list")
    },
    "--balance-by-flops": "slime's split (ceil(tokens / --max-tokens-per-gpu) micro-batches, Karmarkar-Karp on "
    "its forward-FLOPs estimate, coeff from config.json); trainer ranks get the micro-batches by the same cost "
    "largest-first with empty ones padding the count (slime: Karmarkar-Karp with equal counts), and --balance-data "
    "is not implied (lichen has no separate rank balancing to turn on)",
    "--sglang-config": "lichen takes a subset of slime's YAML: regular (and placeholder) server groups, one updatable "
    "model (the policy, its engines --rollout-num-engines) and frozen models launched beside it that weight sync "
    "never reaches; prefill/decode/encoder workers, per-group overrides and unknown keys stop with a usage error "
    "naming the key; plug-ins reach frozen models through lichen.engines.clients.frozen_models (keyed servers), not "
    "args.sglang_model_routers",
    "--no-save-optim": "the learning-rate schedule's position is still saved (Megatron leaves its scheduler out "
    "too); a resume from such a checkpoint starts a fresh optimizer with a warning (slime: its reloads skip the "
    "optimizer; a first --load needs Megatron's --no-load-optim)",
    "--save-hf": "written at every lichen checkpoint save (every --save-interval steps and at the end of the run), "
    "so it needs --save (slime: at its --save-interval saves only, nothing without them); the float32 export of "
    "the checkpoint's hf/ (slime: --hf-checkpoint's dtype and quantization)",
    "--ci-train-rollout-logprob-abs-diff-threshold": "checked whenever given, once per rollout step, stopping the "
    "run with one line and exit code 1 (slime: an assertion per optimizer step, only under --ci-test); a slime "
    "script's --ci-test sets slime's default 0.1 here",
    "--qwen-gdn-backend": "lichen adds torch (transformers' reference code, CPU); unset picks fla where CUDA and fla "
    "are present, else torch (slime: default fla); flashqla is refused on lichen's HF path (not bound yet)",
}
LOCAL_RUNTIME_ONLY = ("--train-env-vars", "--colocate")  # with --runtime ray these have slime's meaning

# lichen defaults that are not slime's: a slime script that leaves the flag out gets a "differs" row saying so.
DEFAULT_DIFFERS: dict[str, str] = {
    "--weight-decay": "not given: lichen's default 0.0 (slime 0.01 via Megatron); give --weight-decay 0.01 for slime's",
    "--lr-decay-style": "not given: lichen's default constant (slime linear via Megatron); give --lr-decay-style "
    "linear for slime's",
}

# Differences that only some values of a flag have: flag -> {value: note}.
_MATH_EQUIVALENCE = (
    "\\boxed only, as slime; equivalence by math-verify (slime: MATH normalisation + sympy), so an "
    "edge case such as an unreduced fraction can grade differently"
)
VALUE_DIFFERS: dict[str, dict[str, str]] = {
    "--rm-type": {
        "math": _MATH_EQUIVALENCE,
        "deepscaler": _MATH_EQUIVALENCE,
        "dapo": "last 300 characters as slime; lichen's answer normalisation (numbers within 1e-6; slime compares "
        "normalised strings with the integer label)",
        "gpqa": "letters and labels as slime; the letter is the last answer statement or boxed letter (slime: the "
        "first pattern that matches)",
    },
    "--advantage-estimator": {
        "ppo": "does not force --offload-train (slime does for PPO); offloading moves memory, not results",
    },
}


def differs_note(flag: str, values: list[str], *, local: bool = True) -> str:
    """How lichen's flag of slime's name differs from slime's with these values and runtime ("" when it does
    not)."""
    if flag in DIFFERS and (local or flag not in LOCAL_RUNTIME_ONLY):
        return DIFFERS[flag]
    return VALUE_DIFFERS.get(flag, {}).get(values[0] if values else "", "")
