"""LoRA in the trainer and the loop (docs/lora.md): only adapters train, the engines serve the merged policy, the
reference is the base model, adapters checkpoint and resume exactly, and the adapter directory is peft's."""

from __future__ import annotations

import pytest
import torch
from helpers.runs import base_args, final_weights, run, run_stopped_after_sync
from helpers.trainer import make_actor, ragged_samples

from lichen.models import load_model
from lichen.weights.hf_io import load_hf_state_dict

LORA = ["--use-lora", "--lora-rank", "4", "--lora-alpha", "8"]


def _groups(actor, seed: int = 0):
    samples = ragged_samples(actor.model.cfg.vocab_size, seed=seed)
    for i, s in enumerate(samples):
        s.reward = float(i % 3)  # non-zero advantages: the adapters get gradients
    return [samples[i : i + 4] for i in range(0, len(samples), 4)]


@pytest.mark.parametrize("extra", [[], ["--gradient-checkpointing", "--bf16"]], ids=["plain", "checkpointed-bf16"])
def test_only_adapters_train_and_sit_in_the_optimizer(tiny_ckpt, addition_data, tmp_path, extra):
    actor = make_actor(tiny_ckpt, addition_data, tmp_path, *LORA, *extra)
    adapters = {n: p for n, p in actor.model.named_parameters() if ".lora_" in n}
    base = {n: p.detach().clone() for n, p in actor.model.named_parameters() if ".lora_" not in n}
    in_optimizer = [p for group in actor.optimizer.param_groups for p in group["params"]]
    assert len(adapters) == 2 * 14 and len(in_optimizer) == len(adapters)
    assert {id(p) for p in in_optimizer} == {id(p) for p in adapters.values()}
    before = {n: p.detach().clone() for n, p in adapters.items()}
    for step in range(2):
        actor.train(step, _groups(actor, seed=step))
    after = dict(actor.model.named_parameters())
    assert all(torch.equal(after[n], w) for n, w in base.items())  # bit-identical base weights
    assert any(not torch.equal(after[n], w) for n, w in before.items() if ".lora_B" in n)  # B moved off 0
    state = actor.optimizer.state_dict()["state"]
    assert len(state) == len(adapters)


def test_reference_is_the_base_model_and_merged_weights_are_the_policy(tiny_ckpt, addition_data, tmp_path):
    from lichen.train.micro_batches import StepBatch
    from lichen.train.train_batch import TrainBatch

    actor = make_actor(tiny_ckpt, addition_data, tmp_path, *LORA, "--use-kl-loss", "--kl-loss-coef", "0.1")
    actor.train(0, _groups(actor))
    base = load_model(tiny_ckpt).eval()
    merged = load_model(tiny_ckpt).eval()
    merged.load_state_dict(dict(actor.named_weights()), strict=True)
    tb = TrainBatch.from_samples([s for g in _groups(actor, seed=5) for s in g], actor.pad_id, actor.device)
    plans = actor.planner().no_grad(list(range(tb.num_samples)), tb.host.input_lengths)
    lp = lambda model: actor.log_probs.of_batch(model, tb.host, plans, tb.response_width)  # noqa: E731
    assert isinstance(tb.host, StepBatch)
    actor.model.eval()
    ref, policy = lp(actor.ref_model), lp(actor.model)
    assert torch.equal(ref, lp(base))  # adapters disabled == the base weights, exactly
    assert actor.ref_model.model is actor.model  # ... of the policy's own module: no second model
    assert (policy - lp(merged)).abs().max().item() <= 1e-5  # merged weights compute the trained policy
    assert (policy - ref).abs().max().item() > 1e-4  # the adapters changed the policy: the checks can fail


@pytest.mark.slow
@pytest.mark.parametrize(
    "engines",
    [[], ["--rollout-num-engines", "1"], ["--model-impl", "hf"]],
    ids=["in-process", "lichen-serve", "hf-module"],
)
def test_engines_serve_the_merged_policy(tiny_ckpt, addition_data, tmp_path, launched, engines):
    """The engines (in process, or a launched `lichen serve`; lichen's model code or transformers' module) get
    merged full weights each step: the rollout's log-probs equal the trainer's (unmerged forward), and
    --check-weight-update-equal finds the engine's weights equal to the trainer's merged ones."""
    rows = run(
        base_args(
            tiny_ckpt,
            addition_data,
            tmp_path / "r",
            "--num-rollout",
            "4",
            "--micro-batch-size",
            "4",
            "--check-weight-update-equal",
            "--save",
            str(tmp_path / "c"),
            *LORA,
            "--lr",
            "0.05",
            *engines,
        )
    )
    assert len(launched) == int("--rollout-num-engines" in engines)
    for m in rows:
        assert m["train/train_rollout_logprob_abs_diff"] <= 1e-5
    base, trained = load_hf_state_dict(tiny_ckpt), final_weights(tmp_path / "c")
    assert base.keys() == trained.keys()
    moved = max((base[k] - trained[k]).abs().max().item() for k in base)
    assert moved > 1e-3  # the policy the engines served moved away from the base


def test_exact_resume(tiny_ckpt, addition_data, tmp_path):
    """4 steps straight == 2 steps + save + --load + 2 steps: same adapters, optimizer, metrics."""
    common = [
        "--micro-batch-size",
        "2",
        "--rollout-shuffle",
        "--save-interval",
        "2",
        "--lr-decay-style",
        "cosine",
        "--num-rollout",
        "4",
        *LORA,
        "--lr",
        "0.02",
    ]
    straight = run(base_args(tiny_ckpt, addition_data, tmp_path / "a", "--save", str(tmp_path / "ca"), *common))
    half = base_args(tiny_ckpt, addition_data, tmp_path / "b", "--save", str(tmp_path / "cb"), *common)
    run_stopped_after_sync(half, stop_at=2)
    resumed = run(
        base_args(
            tiny_ckpt,
            addition_data,
            tmp_path / "b",
            "--save",
            str(tmp_path / "cb"),
            "--load",
            str(tmp_path / "cb"),
            *common,
        )
    )
    from lichen.train.lora import read_adapter

    aa, ab = read_adapter(str(tmp_path / "ca/iter_0000003/lora")), read_adapter(str(tmp_path / "cb/iter_0000003/lora"))
    assert aa.keys() == ab.keys() and all(torch.equal(aa[k], ab[k]) for k in aa)
    tail = [m for m in resumed if m["step"] > 2]
    assert [m["step"] for m in tail] == [3, 4]
    for a, b in zip(straight[2:], tail):
        for key in ("rollout/reward_mean", "train/loss", "train/grad_norm", "train/lr"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), key


def test_resume_without_use_lora_is_refused(tiny_ckpt, addition_data, tmp_path, capsys):
    from lichen.cli import main

    argv = base_args(tiny_ckpt, addition_data, tmp_path / "a", "--num-rollout", "1", "--save", str(tmp_path / "c"))
    assert main(argv + LORA) == 0
    capsys.readouterr()
    assert main(argv + ["--load", str(tmp_path / "c")]) == 2
    assert "saved with --use-lora" in capsys.readouterr().err


def test_adapter_directory_is_peft_s_and_lora_load_restores_it(tiny_ckpt, addition_data, tmp_path):
    """--save-lora writes what PeftModel.from_pretrained loads onto transformers' model of the base checkpoint (same
    logits as the merged export); --lora-load starts a new run's policy there."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert main_ok(
        base_args(
            tiny_ckpt,
            addition_data,
            tmp_path / "a",
            "--num-rollout",
            "2",
            "--lr",
            "0.05",
            "--save",
            str(tmp_path / "c"),
            "--save-lora",
            str(tmp_path / "ad_{rollout_id}"),
            "--lora-save-merged-hf",
            str(tmp_path / "mg_{rollout_id}"),
            *LORA,
        )
    )
    ids = torch.tensor([[5, 9, 11, 3, 7, 21]])
    hf = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(hf, str(tmp_path / "ad_1")).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "mg_1"), dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        a, m, b = with_adapter(ids).logits, merged(ids).logits, base(ids).logits
    assert (a - m).abs().max().item() <= 1e-5 and (a - b).abs().max().item() > 1e-4

    actor = make_actor(tiny_ckpt, addition_data, tmp_path, *LORA, "--lora-load", str(tmp_path / "ad_1"))
    mg = load_hf_state_dict(str(tmp_path / "mg_1"))
    assert max((mg[k] - w).abs().max().item() for k, w in actor.named_weights()) <= 1e-6


def main_ok(argv) -> bool:
    from lichen.cli import main

    return main(argv) == 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe", "gpt_oss", "qwen3_next", "deepseek_v3"])
def test_moe_architectures_train_adapters_and_serve_the_merged_policy(addition_data, tmp_path, arch):
    """moe_language (attention + shared experts; routed experts stay frozen) on each MoE / hybrid architecture
    make-tiny-model builds (transformers' module, --model-impl auto): 2 steps, the engine's log-probs equal the
    trainer's and its weights the merged ones, and the policy moved."""
    from lichen.models.tiny import make_tiny_model

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
            "moe_language",
        )
    )
    assert all(m["train/train_rollout_logprob_abs_diff"] <= 1e-5 for m in rows)
    # the base as the module names it (transformers 5 fuses the experts the checkpoint stores one by one)
    base = {k: p.detach() for k, p in load_model(ckpt).named_parameters()}
    trained = final_weights(tmp_path / "c")
    assert base.keys() == trained.keys()
    moved = {k for k in trained if not torch.equal(trained[k], base[k])}
    assert moved and all(".self_attn." in k or ".shared_expert" in k for k in moved), sorted(moved)[:4]
