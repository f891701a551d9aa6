"""LoRA flags (docs/lora.md): slime's names and defaults, what is refused with exit 2, slime's Megatron regexes
translated to HF names, and the adapted-module listing of every architecture make-tiny-model builds."""

from __future__ import annotations

import re

import pytest

from lichen.cli import main
from lichen.config import parse_train_args
from lichen.config.lora import checkpoint_targets, preset_listing
from lichen.config.lora_config import PRESETS, LoraConfig, translate_pattern
from lichen.errors import ConfigError


def _argv(ckpt, data, *extra):
    return [
        "--hf-checkpoint",
        ckpt,
        "--prompt-data",
        data,
        "--rm-type",
        "math",
        "--num-rollout",
        "1",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        *extra,
    ]


def _train(ckpt, data, capsys, *extra) -> tuple[int, str]:
    code = main(["train", *_argv(ckpt, data, "--dry-run", *extra)])
    return code, capsys.readouterr().err


def test_dry_run_names_the_adapted_modules(tiny_ckpt, addition_data, capsys):
    code, err = _train(tiny_ckpt, addition_data, capsys, "--use-lora")
    assert code == 0, err
    line = next(x for x in err.splitlines() if x.startswith("LoRA:"))
    assert "preset dense_language, rank 64, alpha 128 (scale 2)" in line
    assert "14 of the checkpoint's 15 weight matrices" in line
    assert "model.layers.{0-1}.self_attn.q_proj" in line and "embed_tokens" not in line


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--lora-dropout", "0.05"], "on-policy"),
        (["--lora-rollout-sync-mode", "native_adapter"], "no adapter endpoint"),
        (["--ref-load", "{ckpt}"], "adapters disabled"),
        (["--lora-target-preset", "dense_mlp", "--lora-target-modules", "q_proj"], "only one"),
        (["--lora-target-preset", "moe_routed_experts"], "adapts no module"),  # ... nor routed experts
        (["--lora-target-modules", "linear_q_down_proj"], "MLA"),
        (["--lora-target-modules", "nothing_here"], "adapts no module"),
        (["--lora-target-modules", "embed_tokens", "--lora-exclude-modules"], "never adapted"),
        (["--lora-target-preset", "moe_shared_mlp"], "adapts no module"),  # a dense model has no shared experts
        (["--lora-rank", "0"], "--lora-rank 0"),
        (["--save-lora", "out/{rollout_id}"], "needs --save"),
        (["--advantage-estimator", "ppo"], "not available yet"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_refused_with_exit_2(tiny_ckpt, addition_data, capsys, extra, needle):
    extra = [x.replace("{ckpt}", tiny_ckpt) for x in extra]
    code, err = _train(tiny_ckpt, addition_data, capsys, "--use-lora", *extra)
    assert code == 2
    assert needle in err and "Traceback" not in err


def test_missing_peft_is_exit_2(tiny_ckpt, addition_data, capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else find_spec(name, *a))
    code, err = _train(tiny_ckpt, addition_data, capsys, "--use-lora")
    assert code == 2 and "pip install 'lichen[lora]'" in err


def test_slime_lora_script_flags_run(tiny_ckpt, addition_data, capsys):
    """The LORA_ARGS of slime's run-qwen3-30B-A3B-lora.sh (a dense preset here) and its TP-only / diagnostic
    LoRA flags: a dry run, with the table on stderr."""
    code, err = _train(
        tiny_ckpt,
        addition_data,
        capsys,
        "--use-lora",
        "--lora-target-preset",
        "moe_language",
        "--lora-rank",
        "32",
        "--lora-alpha",
        "64",
        "--lora-weight-decay",
        "0.1",
        "--lora-allow-replicated-modules",
        "x",
        "--lora-debug",
    )
    assert code == 0, err
    assert "--lora-allow-replicated-modules" in err and "--lora-debug" in err
    assert "LoRA: preset moe_language, rank 32, alpha 64 (scale 2)" in err


def test_lora_flags_need_use_lora(tiny_ckpt, addition_data, capsys):
    code, err = _train(tiny_ckpt, addition_data, capsys, "--lora-rank", "8")
    assert code == 2 and "--lora-rank needs --use-lora" in err


def test_lora_learning_rate_and_weight_decay_reach_the_optimizer_config(tiny_ckpt, addition_data, tmp_path):
    from lichen.config import TrainerConfig

    args = parse_train_args(
        _argv(
            tiny_ckpt,
            addition_data,
            "--output-dir",
            str(tmp_path),
            "--use-lora",
            "--lr",
            "1e-6",
            "--weight-decay",
            "0.1",
            "--lora-learning-rate",
            "1e-4",
        )
    )
    cfg = TrainerConfig.from_args(args)
    assert (cfg.optimizer.lr, cfg.optimizer.weight_decay) == (1e-4, 0.0)  # slime: --lora-weight-decay always wins
    args = parse_train_args(
        _argv(
            tiny_ckpt,
            addition_data,
            "--output-dir",
            str(tmp_path),
            "--use-lora",
            "--lr",
            "1e-6",
            "--lora-weight-decay",
            "0.1",
        )
    )
    cfg = TrainerConfig.from_args(args)
    assert (cfg.optimizer.lr, cfg.optimizer.weight_decay) == (1e-6, 0.1)
    assert TrainerConfig.from_args(parse_train_args(_argv(tiny_ckpt, addition_data))).lora is None


# slime's own preset regexes (slime/utils/lora_config.py) as a user would paste them into --lora-target-modules
SLIME_DENSE_LANGUAGE = [
    r"(?:^|\.)decoder\.layers\.\d+\.self_attention\.linear_qkv$",
    r"(?:^|\.)decoder\.layers\.\d+\.self_attention\.linear_proj$",
    r"(?:^|\.)decoder\.layers\.\d+\.mlp\.linear_fc1$",
    r"(?:^|\.)decoder\.layers\.\d+\.mlp\.linear_fc2$",
]


def test_slime_megatron_regexes_select_what_the_preset_selects(tiny_ckpt):
    names = checkpoint_targets(tiny_ckpt)
    translated = tuple(translate_pattern(p, "--lora-target-modules") for p in SLIME_DENSE_LANGUAGE)
    by_regex = LoraConfig(8, 16, translated, (), None, 1e-3, 0.0, None, None, None, "merged").adapted(names)
    by_preset = LoraConfig(
        8, 16, PRESETS["dense_language"], (), "dense_language", 1e-3, 0.0, None, None, None, "merged"
    ).adapted(names)
    assert by_regex == by_preset and len(by_preset) == 14


@pytest.mark.parametrize(
    "pattern, hf_name, matches",
    [
        (r"decoder\.layers\.\d+\.mlp\.shared_experts\.linear_fc1$", "model.layers.3.mlp.shared_expert.up_proj", True),
        (
            r"decoder\.layers\.\d+\.mlp\.shared_experts\.linear_fc2$",
            "model.layers.3.mlp.shared_experts.down_proj",
            True,
        ),
        (r"self_attention\.linear_qkv$", "model.layers.0.self_attn.o_proj", False),
        (r"linear_fc1$", "model.layers.0.mlp.gate_up_proj", True),  # GLM-4's fused gate/up
        # routed experts: the stacked parameters transformers builds (not the shared experts, not a dense MLP)
        (r"decoder\.layers\.\d+\.mlp\.experts\.linear_fc1$", "model.layers.1.mlp.experts.gate_up_proj", True),
        (r"decoder\.layers\.\d+\.mlp\.experts\.linear_fc2$", "model.layers.1.mlp.experts.down_proj", True),
        (r"decoder\.layers\.\d+\.mlp\.experts\.linear_fc1$", "model.layers.1.mlp.shared_experts.up_proj", False),
        (r"decoder\.layers\.\d+\.mlp\.linear_fc1$", "model.layers.1.mlp.experts.gate_up_proj", False),
        (r"self_attn\.q_proj$", "model.layers.0.self_attn.q_proj", True),  # HF names pass unchanged
    ],
)
def test_megatron_translation(pattern, hf_name, matches):
    assert bool(re.search(translate_pattern(pattern, "--lora-target-modules"), hf_name)) is matches


@pytest.mark.parametrize("pattern", [r"in_proj_qkv$", r"linear_kv_up_proj"])
def test_untranslatable_megatron_pieces_are_named(pattern):
    with pytest.raises(ConfigError, match=re.escape(repr(pattern))):
        translate_pattern(pattern, "--lora-target-modules")


def test_listing_in_the_docs_is_the_functions(tmp_path):
    """docs/lora.md's per-architecture table is preset_listing's output for every make-tiny-model architecture,
    and the checkpoint's names (what --dry-run reads) select exactly what apply_lora adapts in the model (Linear
    modules and the routed experts' stacked parameters), for every preset."""
    from pathlib import Path

    from lichen.config.lora_config import DEFAULT_EXCLUDES
    from lichen.models import load_model
    from lichen.models.tiny import all_archs, make_tiny_model
    from lichen.train.lora import target_names

    doc = (Path(__file__).resolve().parent.parent / "docs" / "lora.md").read_text()
    rows = []
    for arch in all_archs():
        out = str(tmp_path / arch)
        make_tiny_model(out, arch=arch)
        names = checkpoint_targets(out)
        for presets, adapted in preset_listing(names):
            rows.append(f"| `{arch}` | {presets} | {adapted} |")
            assert rows[-1] in doc.splitlines(), f"docs/lora.md lacks the row {rows[-1]}"
        linear, stacked = target_names(load_model(out))
        live = linear + stacked
        for preset in PRESETS:
            cfg = LoraConfig(1, 1.0, PRESETS[preset], DEFAULT_EXCLUDES, preset, 0.0, 0.0, None, None, None, "merged")
            assert sorted(cfg.adapted(names)) == sorted(cfg.adapted(live)), (arch, preset)
    stale = [line for line in doc.splitlines() if re.match(r"\| `\w+` \| [a-z_]", line) and line not in rows]
    assert not stale, f"docs/lora.md has rows the function no longer gives: {stale[:2]}"


def test_runtime_ray_is_accepted(tiny_ckpt, addition_data, capsys):
    """--use-lora with --runtime ray passes the checks (the multi-rank trainer wraps adapters before sharding;
    tests/test_lora_dist.py runs it)."""
    code, err = _train(
        tiny_ckpt,
        addition_data,
        capsys,
        "--use-lora",
        "--runtime",
        "ray",
        "--actor-num-gpus-per-node",
        "2",
        "--rollout-num-gpus",
        "1",
    )
    assert code == 0, err
    assert "LoRA: preset dense_language" in err
