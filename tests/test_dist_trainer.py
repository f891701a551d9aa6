"""The multi-rank trainer (lichen.train.dist_trainer): 2 FSDP2 ranks over gloo against the single-rank TrainActor,
exact resume per rank count, resume across rank counts, and the sharded checkpoints' checksums. Ranks run in
torch.multiprocessing children."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from helpers.dist_ranks import (
    assert_matches_single_rank,
    config,
    free_port,
    load_error_worker,
    load_worker,
    rank_files,
    rel_diff,
    resume_worker,
    run_ranks,
    save_worker,
    trainer_argv,
    two_ranks_and_local,
)

from lichen.train.step_schedule import plan_cost, split_across_ranks

pytestmark = pytest.mark.e2e  # see the marker in pyproject.toml: make test leaves it to make test-e2e

STEPS = 4


def test_split_across_ranks_balances_tokens_and_pads_to_equal_counts():
    lengths = [10, 9, 3, 2, 1]
    plans = [[[0]], [[1]], [[2, 3]], [[4]]]
    shares = split_across_ranks(plans, lengths, 2)
    assert [len(s) for s in shares] == [2, 2]
    assert shares == [[[[0]], [[4]]], [[[1]], [[2, 3]]]]  # 10 + 1 tokens vs 9 + 5
    # every micro-batch once; a third rank gets an empty (None) slot where it has nothing
    shares = split_across_ranks(plans, lengths, 3)
    assert sorted(str(p) for s in shares for p in s if p is not None) == sorted(str(p) for p in plans)
    assert [len(s) for s in shares] == [2, 2, 2] and sum(p is None for s in shares for p in s) == 2
    assert plan_cost([[2, 3], [4]], lengths) == 10
    assert split_across_ranks([], lengths, 2) == [[], []]


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--use-kl-loss", "--kl-loss-coef", "0.1", "--clip-grad", "0.5"],
        [
            "--num-steps-per-rollout",
            "2",
            "--advantage-estimator",
            "reinforce_plus_plus",
            "--normalize-advantages",
            "--kl-coef",
            "0.05",
        ],
        ["--micro-batch-size", "3", "--use-rollout-logprobs"],
        ["--advantage-estimator", "ppo", "--micro-batch-size", "3"],
    ],
    ids=["grpo", "grpo_kl_loss_clipped", "two_steps_ref_kl_in_reward", "uneven_counts_observed_rows", "ppo_critic"],
)
@pytest.mark.slow
def test_two_ranks_match_single_rank_trainer(tiny_ckpt, addition_data, tmp_path, extra):
    argv = trainer_argv(tiny_ckpt, addition_data, str(tmp_path / "o"), *extra)
    assert_matches_single_rank(*two_ranks_and_local(argv, tmp_path))


@pytest.mark.slow
def test_two_ranks_match_with_opd_teacher(tiny_ckpt, addition_data, tmp_path):
    """On-policy distillation: the teacher (another tiny model) is sharded and scored like the reference."""
    from lichen.models.tiny import make_tiny_model

    teacher = str(tmp_path / "teacher")
    make_tiny_model(
        teacher, arch="llama", hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, seed=1, init_std=0.1
    )
    argv = trainer_argv(
        tiny_ckpt,
        addition_data,
        str(tmp_path / "o"),
        "--use-opd",
        "--opd-teacher-load",
        teacher,
        "--opd-kl-coef",
        "0.5",
    )
    assert_matches_single_rank(*two_ranks_and_local(argv, tmp_path))


@pytest.mark.slow
def test_two_ranks_bf16_mixed_precision(tiny_ckpt, addition_data, tmp_path):
    """--bf16: parameters gathered and computed in bf16 over gloo, float32 master weights and gradients; the
    single rank runs bf16 autocast over float32 weights, so the two agree to bf16 rounding only (measured: grad
    norms within 0.7%)."""
    argv = trainer_argv(tiny_ckpt, addition_data, str(tmp_path / "o"), "--bf16")
    ranks, _, metrics, grads = two_ranks_and_local(argv, tmp_path)
    assert all(g.dtype == torch.float32 for g in ranks[0]["grads"].values())
    assert all(w.dtype == torch.float32 for w in ranks[0]["weights"].values())
    for mine, ref in zip(ranks[0]["metrics"], metrics):
        assert mine["train/grad_norm"] == pytest.approx(ref["train/grad_norm"], rel=0.03)
    assert max(rel_diff(ranks[0]["grads"][n], g) for n, g in grads.items()) < 0.1


@pytest.fixture(scope="module")
def resumed(tiny_ckpt, addition_data, tmp_path_factory):
    """Per rank count: N steps straight vs N/2 + save + load + N/2, and the checkpoint it saved."""
    runs = {}
    for world in (1, 2):
        d = tmp_path_factory.mktemp(f"resume_w{world}")
        argv = trainer_argv(tiny_ckpt, addition_data, str(d / "o"))
        run_ranks(resume_worker, world, argv, [free_port() for _ in range(3)], str(d), str(d / "ckpt"), STEPS)
        runs[world] = {"files": rank_files(d, world), "ckpt": str(d / "ckpt"), "argv": argv}
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_exact_resume_per_rank_count(resumed, world):
    files = resumed[world]["files"]
    assert all(f["start"] == STEPS // 2 for f in files)
    r0 = files[0]
    for name, w in r0["straight"].items():
        assert torch.equal(r0["loaded"][name], r0["at_save"][name]), name
        assert torch.equal(r0["resumed"][name], w), name
    assert all(f["straight"] is None for f in files[1:])
    hf = os.path.join(resumed[world]["ckpt"], f"iter_{STEPS // 2 - 1:07d}", "hf")
    from lichen.weights.hf_io import load_hf_state_dict

    exported = load_hf_state_dict(hf, device="cpu")
    assert all(torch.equal(exported[n], w) for n, w in r0["at_save"].items())


@pytest.mark.slow
def test_exact_resume_with_ppo_critic(tiny_ckpt, addition_data, tmp_path):
    """The critic's sharded weights and optimizer resume too: the policy's next advantages read its values."""
    argv = trainer_argv(tiny_ckpt, addition_data, str(tmp_path / "o"), "--advantage-estimator", "ppo")
    config(argv)
    run_ranks(resume_worker, 2, argv, [free_port() for _ in range(3)], str(tmp_path), str(tmp_path / "ckpt"), STEPS)
    r0 = rank_files(tmp_path, 2)[0]
    assert all(torch.equal(r0["resumed"][n], w) for n, w in r0["straight"].items())


@pytest.mark.slow
@pytest.mark.parametrize("saved_on,loaded_on", [(2, 1), (1, 2)])
def test_resume_across_rank_counts(resumed, tmp_path, saved_on, loaded_on):
    src = resumed[saved_on]
    run_ranks(load_worker, loaded_on, src["argv"], free_port(), str(tmp_path), src["ckpt"], STEPS)
    files = rank_files(tmp_path, loaded_on)
    r0, ref = files[0], src["files"][0]
    for name, w in ref["at_save"].items():
        assert torch.equal(r0["loaded"][name], w), name
        # the optimizer state resharded too: the continued run matches the saving rank count's, up to rounding
        assert torch.allclose(r0["resumed"][name], ref["resumed"][name], rtol=0, atol=1e-5), name


@pytest.fixture(scope="module")
def sharded_ckpt(tiny_ckpt, addition_data, tmp_path_factory):
    """A checkpoint saved on 2 ranks after one step (iter_0000000), and the argv that made it."""
    d = tmp_path_factory.mktemp("sharded")
    argv = trainer_argv(tiny_ckpt, addition_data, str(d / "o"))
    run_ranks(save_worker, 2, argv, free_port(), str(d / "ckpt"), 0)
    return str(d / "ckpt"), argv


@pytest.mark.slow
def test_sharded_checkpoint_has_a_manifest_of_every_shard(sharded_ckpt):
    ckpt, _ = sharded_ckpt
    d = os.path.join(ckpt, "iter_0000000")
    with open(os.path.join(d, "checksums.json")) as f:
        listed = set(json.load(f)["files"])
    shards = {f"dist/{n}" for n in os.listdir(os.path.join(d, "dist"))}
    assert {"dist/__0_0.distcp", "dist/__1_0.distcp", "dist/.metadata"} <= shards
    assert shards <= listed and "hf/model.safetensors" in listed and "meta.json" in listed


@pytest.mark.parametrize("damage", ["flip", "truncate"])
@pytest.mark.slow
def test_damaged_shard_stops_the_load_on_every_rank_naming_the_file(sharded_ckpt, tmp_path, damage):
    src, argv = sharded_ckpt
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(src, ckpt)
    shard = os.path.join(ckpt, "iter_0000000", "dist", "__1_0.distcp")
    with open(shard, "r+b") as f:
        if damage == "flip":  # one bit in the middle of the tensor data
            f.seek(os.path.getsize(shard) // 2)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 1]))
        else:
            f.truncate(os.path.getsize(shard) - 100)
    run_ranks(load_error_worker, 2, argv, free_port(), str(tmp_path), ckpt)
    errors = [f["error"] for f in rank_files(tmp_path, 2)]
    reason = "checksum mismatch" if damage == "flip" else "truncated or overwritten"
    for e in errors:  # both ranks, though only one of them checked that file
        assert e["type"] == "ConfigError" and e["message"].startswith(
            f"{os.path.dirname(os.path.dirname(shard))}/dist/__1_0.distcp: {reason}"
        ), e
    assert errors[0] == errors[1]


@pytest.mark.slow
def test_intact_sharded_checkpoint_loads(sharded_ckpt, tmp_path):
    ckpt, argv = sharded_ckpt
    run_ranks(load_error_worker, 2, argv, free_port(), str(tmp_path), ckpt)
    assert [f["error"] for f in rank_files(tmp_path, 2)] == [None, None]


def test_resume_loads_the_newest_intact_checkpoint_not_the_one_latest_names(tmp_path):
    """The loop verifies the checkpoints on the driver and falls back past a damaged newest one; the ranks must
    load the one it chose (they read `latest` themselves when not told)."""
    from types import SimpleNamespace

    from lichen.loop import NullTrainer, resume
    from lichen.train import checkpoint as ckpt

    save = str(tmp_path / "ckpt")
    for rollout_id in (0, 1):
        ckpt.save_checkpoint(save, rollout_id, NullTrainer(), {"epoch": 0, "sample_offset": rollout_id})
    with open(os.path.join(ckpt.iter_dir(save, 1), ckpt.ROLLOUT_STATE), "a") as f:
        f.write(" ")  # damaged after its save

    class Group(NullTrainer):  # the Ray runtime's trainer: the ranks load their sharded state themselves
        def load(self, load_dir, rollout_id=None):
            self.loaded = (load_dir, rollout_id)

    group, states = Group(), []
    rollout = SimpleNamespace(load_state_dict=states.append)
    assert resume(SimpleNamespace(load=save), group, rollout) == 1
    assert group.loaded == (save, 0) and states == [{"epoch": 0, "sample_offset": 0}]
