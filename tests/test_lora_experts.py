"""LoRA on routed experts (docs/lora.md#targets): transformers' stacked 3-D expert parameters adapted through peft's
`target_parameters`, merged per expert for the engines, trained in the loop with the engine serving the trainer's
policy."""

from __future__ import annotations

import pytest
import torch
from helpers.runs import base_args, final_weights, run
from helpers.trainer import make_actor
from peft.tuners.lora.layer import ParamWrapper

from lichen.config.lora_config import DEFAULT_EXCLUDES, PRESETS, LoraConfig
from lichen.models import load_model
from lichen.models.tiny import make_tiny_model
from lichen.train.lora import adapters_disabled, apply_lora, merge_state, merged_named_weights
from lichen.weights.hf_io import load_hf_state_dict

LORA = ["--use-lora", "--lora-rank", "4", "--lora-alpha", "8"]
MOE_ARCHS = ["qwen3_moe", "glm4_moe", "gpt_oss", "qwen3_next", "deepseek_v3"]


def _cfg(preset: str) -> LoraConfig:
    return LoraConfig(2, 6.0, PRESETS[preset], DEFAULT_EXCLUDES, preset, 1e-3, 0.0, None, None, None, "merged")


def _hidden(model, ids: torch.Tensor) -> torch.Tensor:
    return model.logits(model(ids, torch.arange(ids.shape[1])[None]))


# qwen3_moe stores experts [E, out, in] (F.linear); gpt-oss [E, in, out] (x @ W): both layouts
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_merged_expert_weights_are_w_plus_scaled_ba_per_expert(tmp_path, arch):
    """For each expert e: merged W_e = W_e + alpha/r * B_e A_e, with A_e, B_e read from peft's stacked adapter
    layout (A: [E*r, in], B: [out, r*E] with the expert index fastest); and the plain model holding the merged
    weights computes the adapted model's logits (peft's forward goes through a different path: a parametrization
    of the stacked parameter)."""
    ckpt = str(tmp_path / arch)
    make_tiny_model(ckpt, arch=arch)
    model = load_model(ckpt).eval()
    base = {k: v.detach().clone() for k, v in model.named_parameters()}
    cfg = _cfg("moe_routed_experts")
    names = apply_lora(model, cfg)
    assert names and all(".mlp.experts." in n for n in names)
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.normal_(0, 0.2)
    merged = dict(merged_named_weights(model))
    assert merged.keys() == base.keys()
    # each stacked parameter's wrapper (two nest on one experts module), found by the parameter it adapts
    wrappers = {
        f"{n.replace('.base_layer', '')}.{m.parameter_name}": m
        for n, m in model.named_modules()
        if isinstance(m, ParamWrapper)
    }
    checked = 0
    for name in names:  # model.layers.N.mlp.experts.gate_up_proj
        a, b = wrappers[name].lora_A["default"].weight, wrappers[name].lora_B["default"].weight
        w = base[name]
        n_exp, r = w.shape[0], cfg.rank
        for e in range(n_exp):
            a_e = a.reshape(n_exp, r, -1)[e]  # [r, in]
            b_e = b.reshape(b.shape[0], r, n_exp)[:, :, e]  # [out, r]
            delta = cfg.scale * (b_e @ a_e)  # [out, in]
            if w.shape[1:] != delta.shape:  # the [E, in, out] layout
                delta = delta.T
            torch.testing.assert_close(merged[name][e], w[e] + delta, rtol=0, atol=1e-6)
            checked += 1
    assert checked >= 2 * len(names)
    # the multi-rank trainer merges gathered tensors with its own formula (merge_state): the same weights
    gathered = merge_state(model, {n: p.detach().clone() for n, p in model.named_parameters()})
    assert gathered.keys() == merged.keys()
    assert all(torch.allclose(gathered[k], merged[k], rtol=0, atol=1e-6) for k in merged)
    others = [k for k in base if k not in names]
    assert all(torch.equal(merged[k], base[k]) for k in others)  # only the adapted tensors change

    plain = load_model(ckpt).eval()
    assert not plain.load_state_dict(merged, strict=False).unexpected_keys  # (a tied LM head is not listed)
    ids = torch.tensor([[5, 9, 11, 3, 7, 21, 4, 8]])
    with torch.no_grad():
        adapted, served, before = _hidden(model, ids), _hidden(plain, ids), _hidden(load_model(ckpt).eval(), ids)
    assert (adapted - served).abs().max().item() <= 1e-5
    assert (adapted - before).abs().max().item() > 1e-3  # the adapters change the policy: the check can fail
    with torch.no_grad(), adapters_disabled(model):  # the reference policy: the base model, exactly
        assert torch.equal(_hidden(model, ids), before)


def test_only_expert_adapters_train_and_sit_in_the_optimizer(addition_data, tmp_path):
    """moe_mlp on qwen3_moe: the optimizer holds exactly the adapters (two nested expert wrappers per layer), and
    after a step every base weight, the stacked experts included, is bit-identical."""
    from helpers.dist_ranks import step_batch

    ckpt = str(tmp_path / "moe")
    make_tiny_model(ckpt, arch="qwen3_moe")
    actor = make_actor(ckpt, addition_data, tmp_path, *LORA, "--lora-target-preset", "moe_mlp")
    adapters = {n: p for n, p in actor.model.named_parameters() if ".lora_" in n}
    assert len(adapters) == 2 * 2 * 2  # layers x {gate_up_proj, down_proj} x {A, B}
    in_optimizer = [p for group in actor.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in in_optimizer} == {id(p) for p in adapters.values()}
    base = {n: p.detach().clone() for n, p in actor.model.named_parameters() if ".lora_" not in n}
    actor.train(0, step_batch(actor.model.cfg.vocab_size, 1))  # random rewards: the adapters get gradients
    after = dict(actor.model.named_parameters())
    assert all(torch.equal(after[n], w) for n, w in base.items())
    assert any(not torch.equal(after[n], torch.zeros_like(p)) for n, p in adapters.items() if ".lora_B" in n)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_routed_experts_train_and_the_engine_serves_them(addition_data, tmp_path, arch):
    """moe_language_all (attention + shared experts + routed experts) on every MoE architecture make-tiny-model
    builds: 2 steps through the loop; after each sync the engine's log-probs equal the trainer's (<= 1e-5) and its
    weights the merged ones (--check-weight-update-equal); the routed experts moved, and nothing but the adapted
    weights did."""
    ckpt = str(tmp_path / arch)
    make_tiny_model(ckpt, arch=arch)
    rows = run(
        base_args(
            ckpt,
            addition_data,
            tmp_path / "r",
            "--num-rollout",
            "2",
            "--micro-batch-size",
            "4",
            "--check-weight-update-equal",
            "--save",
            str(tmp_path / "c"),
            *LORA,
            "--lr",
            "0.05",
            "--lora-target-preset",
            "moe_language_all",
            "--save-lora",
            str(tmp_path / "ad_{rollout_id}"),
        )
    )
    assert len(rows) == 2 and all(m["train/train_rollout_logprob_abs_diff"] <= 1e-5 for m in rows)
    model = load_model(ckpt)
    base = {k: p.detach() for k, p in model.named_parameters()}
    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    stacked = [n for n, p in model.named_parameters() if p.dim() == 3 and ".mlp.experts." in n]
    adapted = _cfg("moe_language_all").adapted(linear + stacked)
    adapted_weights = {n if n in stacked else f"{n}.weight" for n in adapted}
    trained = final_weights(tmp_path / "c")
    assert base.keys() == trained.keys()
    moved = {k for k in trained if not torch.equal(trained[k], base[k])}
    assert moved <= adapted_weights, sorted(moved - adapted_weights)[:4]
    assert any(k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")) for k in moved), sorted(moved)[:6]

    # --lora-load starts a new run's policy at the saved adapters (stacked expert adapters included)
    last = int(open(tmp_path / "c" / "latest_checkpointed_iteration.txt").read())
    export = load_hf_state_dict(str(tmp_path / f"c/iter_{last:07d}/hf"))
    actor = make_actor(
        ckpt,
        addition_data,
        tmp_path,
        *LORA,
        "--lora-target-preset",
        "moe_language_all",
        "--lora-load",
        str(tmp_path / "ad_1"),
    )
    assert max((export[k] - w).abs().max().item() for k, w in actor.named_weights()) <= 1e-6
    if arch not in ("qwen3_moe", "gpt_oss"):
        return  # peft's loader rewrites MLP targets of these types on transformers 5 (docs/lora.md#checkpoints)
    # the adapter directory is peft's: PeftModel loads it (target_parameters included) onto transformers' model of
    # the base checkpoint and computes the merged export's logits
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[5, 9, 11, 3, 7, 21]])
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(hf, str(tmp_path / "ad_1")).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / f"c/iter_{last:07d}/hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert (with_adapter(ids).logits - merged(ids).logits).abs().max().item() <= 1e-5
