"""The generic HF path (--model-impl hf) through the whole loop, per architecture (docs/models.md).

Each architecture: 2 training steps of `lichen train` with the in-process engine; rollout/trainer log-prob parity
on both steps (the second step samples from the weights the first step trained, so its parity also shows the
engine serves what the trainer has); the saved HF export reloads with `from_pretrained` with nothing missing and the
same logits as the stored tensors loaded strictly into the module.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.runs import base_args, run
from safetensors.torch import load_file

from lichen.models.hf_archs import HF_ARCHS
from lichen.models.tiny import make_tiny_model

ARCHS = ["llama", "qwen2", "qwen3", *HF_ARCHS]
SMALL = dict(
    hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48, max_position_embeddings=256
)
PARITY = 1e-5  # mean |train - rollout| log-prob, fp32 on CPU (the bound)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf_archs")
    return {arch: make_tiny_model(str(root / arch), arch=arch, **SMALL) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_two_steps_parity_sync_and_export(ckpts, addition_data, tmp_path, arch):
    from transformers import AutoModelForCausalLM

    save = tmp_path / "save"
    rows = run(
        base_args(
            ckpts[arch],
            addition_data,
            tmp_path / "out",
            "--model-impl",
            "hf",
            "--num-rollout",
            "2",
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "2",
            "--rollout-max-response-len",
            "6",
            "--lr",
            "3e-3",
            "--save",
            str(save),
            "--save-interval",
            "2",
        )
    )
    train = [r for r in rows if "train/loss" in r]
    assert len(train) == 2
    diffs = [r["train/train_rollout_logprob_abs_diff"] for r in train]
    print(f"{arch}: train_rollout_logprob_abs_diff per step {diffs}")
    assert max(diffs) <= PARITY, diffs

    export = save / "iter_0000001" / "hf"
    stored = load_file(str(export / "model.safetensors"))
    initial = AutoModelForCausalLM.from_pretrained(ckpts[arch])
    moved = max((stored[n] - p).abs().max().item() for n, p in initial.state_dict().items() if n in stored)
    assert moved > 1e-4  # the second step sampled from trained weights: its parity checks the weight sync
    reloaded, info = AutoModelForCausalLM.from_pretrained(str(export), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    strict = AutoModelForCausalLM.from_config(reloaded.config)
    strict.load_state_dict(stored, strict=not reloaded.config.tie_word_embeddings)
    if reloaded.config.tie_word_embeddings:
        strict.tie_weights()
    ids = torch.tensor([[5, 17, 22, 9, 40, 6]])
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(ids).logits, strict.eval()(ids).logits)
    assert (
        json.load(open(export / "config.json"))["model_type"]
        == json.load(open(f"{ckpts[arch]}/config.json"))["model_type"]
    )


@pytest.mark.parametrize("arch", ["llama", "gpt_oss", "qwen3_next"])  # attention, sliding window, linear attention
def test_packed_rows_equal_separate_forwards(ckpts, arch):
    """The trainer packs several samples into one row with a block-diagonal mask (lichen.train.micro_batches); the
    HF path runs each sample alone, so a packed sample's hidden states are those of its own forward."""
    from lichen.models.loading import load_model

    model = load_model(ckpts[arch], impl="hf")
    samples = [[5, 9, 13, 2, 40, 41, 42], [7, 8, 60, 61], [30, 31, 32, 33, 34]]
    T = 18  # two rows: samples 0+1 (and 7 pads), sample 2 (and 13 pads)
    rows = [[0, 1], [2]]
    ids = torch.zeros((2, T), dtype=torch.long)
    pos = torch.zeros((2, T), dtype=torch.long)
    seg = torch.full((2, T), -1)
    where = {}
    for r, row in enumerate(rows):
        off = 0
        for i in row:
            n = len(samples[i])
            ids[r, off : off + n], pos[r, off : off + n], seg[r, off : off + n] = (
                torch.tensor(samples[i]),
                torch.arange(n),
                i,
            )
            where[i] = (r, off, n)
            off += n
    mask = ((seg[:, :, None] == seg[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril())[:, None]
    with torch.no_grad():
        packed = model(ids, pos, attn_mask=mask)
        for i, sample in enumerate(samples):
            r, off, n = where[i]
            alone = model(torch.tensor([sample]), torch.arange(n)[None])[0]
            assert (packed[r, off : off + n] - alone).abs().max() <= 1e-5, i


def test_ppo_critic_on_the_hf_path(ckpts, addition_data, tmp_path):
    """--advantage-estimator ppo: the critic's backbone is the HF module too (its value head reads hidden_size)."""
    rows = run(
        base_args(
            ckpts["qwen3_moe"],
            addition_data,
            tmp_path / "out",
            "--num-rollout",
            "2",
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "2",
            "--rollout-max-response-len",
            "6",
            "--advantage-estimator",
            "ppo",
        )
    )
    train = [r for r in rows if "train/loss" in r]
    assert len(train) == 2 and max(r["train/train_rollout_logprob_abs_diff"] for r in train) <= PARITY


@pytest.mark.slow
def test_launched_engine_with_disk_sync(ckpts, addition_data, tmp_path, launched):
    """A launched `lichen serve` engine on the HF path, weights synced through disk versions (the module layout
    the trainer writes, read back through from_pretrained)."""
    rows = run(
        base_args(
            ckpts["qwen3_moe"],
            addition_data,
            tmp_path / "out",
            "--num-rollout",
            "2",
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "2",
            "--rollout-max-response-len",
            "6",
            "--rollout-num-engines",
            "1",
            "--update-weight-transport",
            "disk",
            "--update-weight-disk-dir",
            str(tmp_path / "w"),
            "--num-threads",
            "1",
        )
    )
    train = [r for r in rows if "train/loss" in r]
    assert len(launched) == 1 and len(train) == 2
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in train) <= PARITY
    assert [r["sync/weight_version"] for r in train] == [1, 2]
