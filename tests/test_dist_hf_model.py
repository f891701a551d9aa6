"""The multi-rank trainer on the generic HF path (--model-impl hf; lichen.train.dist_trainer, lichen.train.fsdp):
each decoder layer of the transformers module is one FSDP2 unit, found from the module's `_no_split_modules`
(so a layer list outside `model.layers` works: GPT-2's `transformer.h`); 2 ranks against the single-rank trainer
for a dense model, a MoE model with the router's load-balancing loss, and GPT-2; a sharded checkpoint of the MoE
module resumes exactly and its HF export reloads with `from_pretrained`."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers.dist_ranks import (
    assert_matches_single_rank,
    config,
    free_port,
    fsdp_units_worker,
    rank_files,
    resume_worker,
    run_ranks,
    trainer_argv,
    two_ranks_and_local,
)
from helpers.ray_local import shared_ray  # noqa: E402
from helpers.runs import THREADS, base_args, ray_args, run

from lichen.models.tiny import make_tiny_model

pytestmark = pytest.mark.e2e  # see the marker in pyproject.toml: make test leaves it to make test-e2e

SMALL = dict(
    hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48, max_position_embeddings=256
)
STEPS = 4


def _tiny_gpt2(out: str, tokenizer_from: str) -> str:
    """A tiny GPT-2 (decoder layers at `transformer.h`) with the tiny checkpoints' tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    shutil.copytree(tokenizer_from, out)
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=102,
        n_positions=256,
        n_embd=32,
        n_layer=2,
        n_head=4,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    GPT2LMHeadModel(cfg).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("dist_hf")
    out = {arch: make_tiny_model(str(root / arch), arch=arch, **SMALL) for arch in ("llama", "qwen3_moe")}
    out["gpt2"] = _tiny_gpt2(str(root / "gpt2"), out["llama"])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("arch,layers", [("qwen3_moe", "model.layers"), ("gpt2", "transformer.h")])
def test_every_decoder_layer_is_an_fsdp_unit(ckpts, tmp_path, arch, layers):
    run_ranks(fsdp_units_worker, 1, ckpts[arch], free_port(), str(tmp_path))
    got = rank_files(tmp_path, 1)[0]
    assert got["layers"] == 2 and got["units"] == ["", f"{layers}.0", f"{layers}.1"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch,extra",
    [("llama", []), ("qwen3_moe", ["--moe-aux-loss-coeff", "0.1"]), ("gpt2", [])],
    ids=["llama", "qwen3_moe_router_loss", "gpt2"],
)
def test_two_ranks_match_single_rank_trainer(ckpts, addition_data, tmp_path, arch, extra):
    """First-step gradients within 1e-6 relative, losses over 3 steps within 1e-5, weights within 1e-5."""
    argv = trainer_argv(ckpts[arch], addition_data, str(tmp_path / "o"), "--model-impl", "hf", *extra)
    ranks, local, metrics, grads = two_ranks_and_local(argv, tmp_path)
    assert getattr(local.model, "is_hf", False)
    assert_matches_single_rank(ranks, local, metrics, grads)
    if extra:  # the router loss is in the loss and its metric agrees across rank counts
        for mine, ref in zip(ranks[0]["metrics"], metrics):
            assert ref["train/moe_aux_loss"] > 0
            assert mine["train/moe_aux_loss"] == pytest.approx(ref["train/moe_aux_loss"], rel=1e-6)
        router = next(n for n in grads if n.endswith("mlp.gate.weight"))
        assert grads[router].abs().max() > 0


@pytest.mark.slow
def test_moe_checkpoint_resumes_exactly_and_exports_hf(ckpts, addition_data, tmp_path):
    """2 ranks: N steps straight equal N/2 + save + load + N/2, bit for bit; the checkpoint's hf/ (the module's
    parameter names, fused experts) reloads with from_pretrained to the saved weights."""
    from transformers import AutoModelForCausalLM

    argv = trainer_argv(
        ckpts["qwen3_moe"], addition_data, str(tmp_path / "o"), "--model-impl", "hf", "--moe-aux-loss-coeff", "0.1"
    )
    config(argv)
    ckpt = tmp_path / "ckpt"
    run_ranks(resume_worker, 2, argv, [free_port() for _ in range(3)], str(tmp_path), str(ckpt), STEPS)
    r0 = rank_files(tmp_path, 2)[0]
    assert r0["start"] == STEPS // 2
    for name, w in r0["straight"].items():
        assert torch.equal(r0["loaded"][name], r0["at_save"][name]), name
        assert torch.equal(r0["resumed"][name], w), name
    export = ckpt / f"iter_{STEPS // 2 - 1:07d}" / "hf"
    reloaded, info = AutoModelForCausalLM.from_pretrained(str(export), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    state = reloaded.state_dict()
    assert any(".experts." in n for n in r0["at_save"])
    assert all(torch.equal(state[n], w) for n, w in r0["at_save"].items())


@pytest.mark.slow
def test_broadcast_weight_sync_to_an_hf_path_engine(ckpts, addition_data, tmp_path):
    """A launched `lichen serve` on the HF path takes weights over the torch.distributed group (the default
    transport, gloo on CPU): the second step samples from the trained weights with log-probs equal to the
    trainer's."""
    rows = run(
        base_args(
            ckpts["qwen3_moe"],
            addition_data,
            tmp_path / "o",
            "--model-impl",
            "hf",
            "--num-rollout",
            "2",
            "--rollout-num-engines",
            "1",
            "--rollout-max-response-len",
            "6",
            "--lr",
            "3e-3",
            "--device",
            "cpu",
            *THREADS,
        )
    )
    steps = [r for r in rows if "train/loss" in r]
    assert [r["sync/weight_version"] for r in steps] == [1, 2]
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in steps) <= 1e-5


@pytest.mark.slow
def test_ray_runtime_two_ranks_hf_moe_with_router_loss(ckpts, addition_data, tmp_path):
    """--runtime ray --actor-num-gpus-per-node 2 --model-impl hf: 2 FSDP2 trainer ranks of the MoE module and a
    lichen serve engine on the HF path, 2 steps with the router loss, synced weights, a sharded checkpoint."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'lichen[ray]')")
    shared_ray()
    rows = run(
        base_args(
            ckpts["qwen3_moe"],
            addition_data,
            tmp_path / "o",
            "--model-impl",
            "hf",
            "--moe-aux-loss-coeff",
            "0.1",
            "--num-rollout",
            "2",
            *ray_args(2, 1),
            "--save",
            str(tmp_path / "ckpt"),
        )
    )
    steps = [r for r in rows if "train/loss" in r]
    assert [r["sync/weight_version"] for r in steps] == [1, 2]
    assert all(r["train/moe_aux_loss"] > 0 for r in steps)
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in steps) <= 1e-5
    saved = tmp_path / "ckpt" / "iter_0000001"
    assert (saved / "dist").is_dir() and (saved / "hf").is_dir()
