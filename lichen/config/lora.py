"""LoRA flags (slime's names, defaults and meanings; docs/lora.md): train low-rank adapters on a frozen policy.

With `--use-lora` only the adapters train and sit in the optimizer; the engines get merged full weights
(W + alpha/r * B A) at every sync; the reference log-probs come from the same module with its adapters disabled.
The check resolves the targets against the checkpoint's weight names, so `--dry-run` names the adapted modules
(`describe`) and a selection that adapts nothing stops here, not after the model loads.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re

from lichen.config.checks import check_float, check_int_at_least, fail, given
from lichen.config.lora_config import DEFAULT_EXCLUDES, DEFAULT_PRESET, NEVER_ADAPTED, PRESETS, LoraConfig
from lichen.config.parser import flag_of
from lichen.errors import NotAvailableYet

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # peft's adapter directory
_LORA_DESTS = (
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "lora_bias",
    "lora_target_preset",
    "lora_target_modules",
    "lora_exclude_modules",
    "lora_learning_rate",
    "lora_weight_decay",
    "lora_load",
    "save_lora",
    "lora_rollout_sync_mode",
    "lora_save_merged_hf",
)


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("LoRA (docs/lora.md)")
    g.add_argument(
        "--use-lora",
        action="store_true",
        help="train low-rank adapters (peft) on the frozen policy instead of every weight (default: off)",
    )
    g.add_argument("--lora-rank", type=int, default=64, help="adapter rank r")
    g.add_argument("--lora-alpha", type=float, default=128.0, help="adapter alpha; the update is scaled by alpha / r")
    g.add_argument(
        "--lora-dropout",
        type=float,
        default=0.0,
        help="dropout on the adapter input; only 0 runs: training is on-policy, and a random adapter "
        "forward would make the trainer's log-probs disagree with the policy that sampled",
    )
    g.add_argument("--lora-bias", choices=["none"], default="none", help="adapter biases: none (slime's only value)")
    g.add_argument(
        "--lora-target-preset",
        choices=sorted(PRESETS),
        default=None,
        help=f"slime's named set of adapted modules, mapped onto Hugging Face module names (default: "
        f"{DEFAULT_PRESET}: attention and dense MLP projections). Never routers, embeddings or the LM "
        "head. Routed experts (moe_routed_experts, moe_mlp, moe_language_all) are adapted through their "
        "stacked parameters, one adapter per expert (docs/lora.md)",
    )
    g.add_argument(
        "--lora-target-modules",
        nargs="*",
        default=None,
        metavar="REGEX",
        help="regexes (re.search) over module names instead of a preset: Hugging Face names "
        "(self_attn.q_proj), or slime's Megatron names (self_attention.linear_qkv), translated; "
        "pieces with no HF counterpart are refused (default: the preset)",
    )
    g.add_argument(
        "--lora-exclude-modules",
        nargs="*",
        default=None,
        metavar="REGEX",
        help="regexes of modules never adapted, replacing the default list (default: embeddings, LM "
        "head, vision tower, MoE routers)",
    )
    g.add_argument(
        "--lora-learning-rate", type=float, default=None, help="learning rate of the adapters (default: --lr)"
    )
    g.add_argument(
        "--lora-weight-decay",
        type=float,
        default=0.0,
        help="weight decay of the adapters; replaces --weight-decay with --use-lora, as in slime",
    )
    g.add_argument(
        "--lora-load",
        metavar="DIR",
        default=None,
        help="start the adapters from this adapter directory (--save-lora's output: peft's "
        "adapter_config.json + adapter_model.safetensors); a --load resume restores its own "
        "(default: fresh adapters, B = 0)",
    )
    g.add_argument(
        "--save-lora",
        metavar="TEMPLATE",
        default=None,
        help="with every checkpoint also write the adapters to this directory, {rollout_id} filled in "
        "(needs --save; default: adapters only inside the checkpoints)",
    )
    g.add_argument(
        "--lora-rollout-sync-mode",
        choices=["merged", "native_adapter"],
        default="merged",
        help="how the engines get the policy: merged full weights W + alpha/r * B A; native_adapter "
        "is refused (lichen's engines load full weights only)",
    )
    g.add_argument(
        "--lora-save-merged-hf",
        metavar="TEMPLATE",
        default=None,
        help="with every checkpoint also write the merged policy as a Hugging Face checkpoint here, "
        "{rollout_id} filled in (needs --save; default: the checkpoint's hf/ holds it)",
    )


def check(args: argparse.Namespace) -> None:
    if not args.use_lora:
        stray = [flag_of(d) for d in _LORA_DESTS if given(args, d)]
        if stray:
            fail(f"{stray[0]} needs --use-lora: add --use-lora to train adapters, or drop {stray[0]}")
        return
    if importlib.util.find_spec("peft") is None:
        fail("--use-lora needs peft, which is not installed: pip install 'lichen[lora]'")
    check_int_at_least(args, "lora_rank", 1)
    check_float(args, "lora_alpha", low=0, low_open=True)
    check_float(args, "lora_learning_rate", low=0, low_open=True)
    check_float(args, "lora_weight_decay", low=0)
    if args.lora_dropout != 0:
        fail(
            f"--lora-dropout {args.lora_dropout}: only 0 runs: training is on-policy, and dropout in the adapters "
            "would make the trainer's log-probs disagree with the policy that sampled; use --lora-dropout 0"
        )
    if args.lora_rollout_sync_mode == "native_adapter":
        raise NotAvailableYet(
            "--lora-rollout-sync-mode native_adapter is not available yet: lichen's engines (in "
            "process and lichen serve) load full weights only and have no adapter endpoint; use "
            "--lora-rollout-sync-mode merged"
        )
    if args.ref_load is not None:
        fail(
            "--ref-load with --use-lora: the reference policy is the base model, i.e. the same module with its "
            "adapters disabled (no second model); remove --ref-load"
        )
    # slime refuses both (slime/utils/lora_config.py, validate_lora_args): a critic is not adapter-based, and the
    # OPD teacher's snapshot has no adapter bookkeeping
    for refused, why in (
        (args.advantage_estimator == "ppo", "--advantage-estimator ppo (its critic is a full model)"),
        (args.use_opd, "--use-opd"),
    ):
        if refused:
            raise NotAvailableYet(f"--use-lora with {why} is not available yet; drop one of them")
    for dest in ("save_lora", "lora_save_merged_hf"):
        _check_template(args, dest)
    if args.lora_load is not None:
        missing = [f for f in ADAPTER_FILES if not os.path.isfile(os.path.join(args.lora_load, f))]
        if missing:
            fail(f"--lora-load {args.lora_load!r}: no {', '.join(missing)} there; give a directory --save-lora wrote")
    _check_targets(LoraConfig.from_args(args), args.hf_checkpoint)


def _check_template(args: argparse.Namespace, dest: str) -> None:
    template = getattr(args, dest)
    if template is None:
        return
    if args.save is None:
        fail(f"{flag_of(dest)} needs --save DIR: it is written with every checkpoint")
    try:
        template.format(rollout_id=0)
    except (KeyError, IndexError, ValueError) as e:
        fail(
            f"{flag_of(dest)} {template!r}: not a template with {{rollout_id}} only ({e!r}); e.g. "
            "out/lora_{rollout_id}"
        )


def _check_targets(cfg: LoraConfig, hf_checkpoint: str) -> None:
    names = checkpoint_targets(hf_checkpoint)
    if names is None:
        return  # no safetensors to read the names from: the trainer checks its module instead
    adapted = cfg.adapted(names)
    never = [n for n in adapted if NEVER_ADAPTED.search(n)]
    if never:
        fail(f"--lora-target-modules selects {never[0]}: embeddings and the LM head are never adapted; exclude them")
    if not adapted:
        flag = "--lora-target-modules" if cfg.preset is None else f"--lora-target-preset {cfg.preset}"
        fail(
            f"{flag} adapts no module of --hf-checkpoint {hf_checkpoint} (its linear modules: "
            f"{', '.join(collapse_layers(names)[:8])}); choose a preset or regexes that match (docs/lora.md)"
        )


# transformers stacks a checkpoint's per-expert projections into one parameter per MoE layer (Mixtral-style w1/w3/w2
# too); a checkpoint may also store them stacked already (gpt-oss). Either way the module's name is the stacked one.
_PER_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)$")
_STACKED = {
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
    "w1": "gate_up_proj",
    "w3": "gate_up_proj",
    "down_proj": "down_proj",
    "w2": "down_proj",
}


def checkpoint_targets(model_dir: str) -> list[str] | None:
    """What LoRA can adapt in `model_dir`, named as the loaded module names it, read from the safetensors headers
    (no torch), in file order: the Linear modules (2-D `*.weight` tensors) and the routed experts' stacked
    parameters (`model.layers.1.mlp.experts.gate_up_proj`, built from per-expert tensors or stored 3-D); None when
    the checkpoint has no safetensors."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(model_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        return None
    names: dict[str, None] = {}  # ordered set: the per-expert tensors collapse onto one stacked name
    for file in files:
        with open(os.path.join(model_dir, file), "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for key, v in header.items():
            if key == "__metadata__":
                continue
            if len(v["shape"]) == 3 and ".experts." in key:
                names[key] = None
            elif len(v["shape"]) == 2 and key.endswith(".weight"):
                module = key[: -len(".weight")]
                m = _PER_EXPERT.match(module)
                names[f"{m.group(1)}.{_STACKED[m.group(2)]}" if m else module] = None
    return list(names)


def collapse_layers(names: list[str]) -> list[str]:
    """`model.layers.0.x`, `model.layers.1.x` -> `model.layers.{0-1}.x` (first-seen order), for one-line output."""
    groups: dict[str, list[int]] = {}
    for name in names:
        m = re.search(r"\.layers\.(\d+)\.", name)
        key = name if m is None else name[: m.start(1)] + "{}" + name[m.end(1) :]
        groups.setdefault(key, []).append(-1 if m is None else int(m.group(1)))
    out = []
    for key, layers in groups.items():
        if layers == [-1]:
            out.append(key)
            continue
        lo, hi = min(layers), max(layers)
        span = f"{{{lo}-{hi}}}" if len(layers) == hi - lo + 1 else "{" + ",".join(map(str, sorted(layers))) + "}"
        out.append(key.format(span) if hi > lo else key.format(lo))
    return out


def preset_listing(module_names: list[str]) -> list[tuple[str, str]]:
    """(presets, what they adapt of `module_names`) rows, as docs/lora.md's table shows them: presets that adapt
    the same modules share a row; "layers {0-1}: `mlp.down_proj`, ..." per layer span, or "none". The default
    excludes apply."""
    rows: dict[str, list[str]] = {}
    for preset, targets in PRESETS.items():
        cfg = LoraConfig(1, 1.0, targets, DEFAULT_EXCLUDES, preset, 0.0, 0.0, None, None, None, "merged")
        spans: dict[str, list[str]] = {}
        for name in sorted(collapse_layers(cfg.adapted(module_names))):
            m = re.match(r"^(?:.*\.)?layers\.(\{[^}]*\}|\d+)\.(.*)$", name)
            span, leaf = (f"layers {m.group(1)}", m.group(2)) if m else ("other", name)
            spans.setdefault(span, []).append(f"`{leaf}`")
        rows.setdefault(
            "; ".join(f"{span}: {', '.join(leaves)}" for span, leaves in spans.items()) or "none", []
        ).append(preset)
    return [(", ".join(presets), adapted) for adapted, presets in rows.items()]


def describe(args: argparse.Namespace) -> str:
    """The --dry-run line: which modules --use-lora adapts in --hf-checkpoint, with rank and scale."""
    cfg = LoraConfig.from_args(args)
    assert cfg is not None
    names = checkpoint_targets(args.hf_checkpoint)
    what = f"preset {cfg.preset}" if cfg.preset else "--lora-target-modules"
    head = f"LoRA: {what}, rank {cfg.rank}, alpha {cfg.alpha:g} (scale {cfg.scale:g}), lr {cfg.lr:g}"
    if names is None:
        return head + ": no safetensors in --hf-checkpoint to list the adapted modules from"
    adapted = cfg.adapted(names)
    return (
        f"{head}: {len(adapted)} of the checkpoint's {len(names)} weight matrices adapted: "
        f"{', '.join(collapse_layers(adapted))}"
    )
