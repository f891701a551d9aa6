"""slime's --reset-optimizer-states, --no-save-optim, --save-hf and --ci-train-rollout-logprob-abs-diff-threshold
(issue 30 item 4): the local trainer, one FSDP2 rank through DCP, the CLI, and their rows in the slime table."""

from __future__ import annotations

import json
import logging
import os
import re

import pytest
import torch
from helpers.dist_ranks import free_ports, run_ranks, step_batch, trainer_argv
from helpers.runs import base_args
from helpers.trainer import make_actor, ragged_samples

from lichen.cli import main
from lichen.config import build_train_parser, parse_train_args, slime_compat
from lichen.config.parser import option_actions
from lichen.config.slime.flags import DIFFERS_CLASS, SAME
from lichen.errors import ConfigError, RunError
from lichen.torch_files import load_plain
from lichen.train import checkpoint
from lichen.train.optim import make_adamw
from lichen.weights.hf_io import load_hf_state_dict

FLAGS = (
    "--reset-optimizer-states",
    "--no-save-optim",
    "--save-hf",
    "--ci-train-rollout-logprob-abs-diff-threshold",
)


def _groups(actor, step: int) -> list[list]:
    samples = ragged_samples(actor.model.cfg.vocab_size, seed=10 + step)
    for s in samples:
        s.reward = float((s.index * 7 + step) % 5) / 4
    return [samples[i : i + 4] for i in range(0, len(samples), 4)]


def _steps(optimizer) -> set[float]:
    return {float(s["step"]) for s in optimizer.state.values()}


# --- --reset-optimizer-states ------------------------------------------------------------------------------------


def test_reset_optimizer_states_is_a_fresh_adamw_each_rollout_step_on_the_same_lr_schedule(
    tiny_ckpt, addition_data, tmp_path
):
    schedule = ["--lr-warmup-iters", "3"]  # the learning rate differs per step: a reset schedule would show
    reset = make_actor(tiny_ckpt, addition_data, tmp_path / "a", "--reset-optimizer-states", *schedule)
    fresh = make_actor(tiny_ckpt, addition_data, tmp_path / "b", *schedule)
    kept = make_actor(tiny_ckpt, addition_data, tmp_path / "c", *schedule)
    lrs = {}
    for name, actor in (("reset", reset), ("fresh", fresh), ("kept", kept)):
        actor.train(0, _groups(actor, 0))
        assert _steps(actor.optimizer) == {1.0}
        if name == "fresh":  # what a reset must equal: an AdamW that never stepped, same weights, same opt_step
            actor.optimizer = make_adamw(
                [p for p in actor.model.parameters() if p.requires_grad],
                lr=1e-3,
                betas=actor.cfg.optimizer.betas,
                eps=actor.cfg.optimizer.eps,
                weight_decay=actor.cfg.optimizer.weight_decay,
            )
        lrs[name] = actor.train(1, _groups(actor, 1))["train/lr"]
    assert _steps(reset.optimizer) == {1.0} and _steps(kept.optimizer) == {2.0}
    assert lrs["reset"] == lrs["kept"] == lrs["fresh"] > 0  # the schedule went on: step 1 of the warm-up
    w = {n: p.detach() for n, p in reset.model.named_parameters()}
    assert all(torch.equal(w[n], p) for n, p in fresh.model.named_parameters())
    assert any(not torch.equal(w[n], p) for n, p in kept.model.named_parameters())


def test_reset_optimizer_states_resets_the_ppo_critic_too(tiny_ckpt, addition_data, tmp_path):
    actor = make_actor(tiny_ckpt, addition_data, tmp_path, "--reset-optimizer-states", "--advantage-estimator", "ppo")
    for k in range(2):
        actor.train(k, _groups(actor, k))
    assert _steps(actor.critic.optimizer) == {1.0} and _steps(actor.optimizer) == {1.0}


# --- --no-save-optim and --save-hf, local trainer ----------------------------------------------------------------


def test_no_save_optim_checkpoint_resumes_with_a_fresh_optimizer_and_one_warning(
    tiny_ckpt, addition_data, tmp_path, caplog
):
    flags = ["--advantage-estimator", "ppo", "--no-save-optim", "--save", str(tmp_path / "ck")]
    saver = make_actor(tiny_ckpt, addition_data, tmp_path / "s", *flags)
    saver.train(0, _groups(saver, 0))
    checkpoint.save_checkpoint(str(tmp_path / "ck"), 0, saver, {})
    d = checkpoint.iter_dir(str(tmp_path / "ck"), 0)
    state = load_plain(os.path.join(d, checkpoint.TRAINER_STATE), "t")
    assert "optimizer" not in state and state["opt_step"] == 1 and "rng" in state
    assert "optimizer" not in load_plain(os.path.join(d, checkpoint.CRITIC_FILE), "t")
    loader = make_actor(tiny_ckpt, addition_data, tmp_path / "l", *flags)
    with caplog.at_level(logging.WARNING):
        loader.load(str(tmp_path / "ck"), checkpoint.find_latest(str(tmp_path / "ck")))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "no optimizer state" in warnings[0] and "--no-save-optim" in warnings[0]
    assert loader.optimizer.state_dict()["state"] == {} and loader.critic.optimizer.state_dict()["state"] == {}
    assert loader.opt_step == 1
    assert all(torch.equal(p, q) for p, q in zip(saver.model.parameters(), loader.model.parameters()))
    loader.train(1, _groups(loader, 1))  # the fresh optimizer steps
    assert _steps(loader.optimizer) == {1.0}


def test_a_normal_checkpoint_keeps_the_optimizer(tiny_ckpt, addition_data, tmp_path, caplog):
    saver = make_actor(tiny_ckpt, addition_data, tmp_path / "s", "--save", str(tmp_path / "ck"))
    saver.train(0, _groups(saver, 0))
    checkpoint.save_checkpoint(str(tmp_path / "ck"), 0, saver, {})
    loader = make_actor(tiny_ckpt, addition_data, tmp_path / "l")
    with caplog.at_level(logging.WARNING):
        loader.load(str(tmp_path / "ck"), 0)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert _steps(loader.optimizer) == {1.0}
    assert not (tmp_path / "hf_0").exists()


def test_save_hf_writes_the_checkpoints_hf_export_per_rollout_id(tiny_ckpt, addition_data, tmp_path):
    template = str(tmp_path / "export" / "step_{rollout_id}")
    actor = make_actor(tiny_ckpt, addition_data, tmp_path, "--save", str(tmp_path / "ck"), "--save-hf", template)
    for k in range(2):
        actor.train(k, _groups(actor, k))
        checkpoint.save_checkpoint(str(tmp_path / "ck"), k, actor, {})
    for k in range(2):
        out = tmp_path / "export" / f"step_{k}"
        assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
        exported = load_hf_state_dict(str(out))
        inside = load_hf_state_dict(os.path.join(checkpoint.iter_dir(str(tmp_path / "ck"), k), "hf"))
        assert exported.keys() == inside.keys() and all(torch.equal(exported[n], inside[n]) for n in inside)
    first, second = (load_hf_state_dict(str(tmp_path / "export" / f"step_{k}")) for k in range(2))
    assert any(not torch.equal(first[n], second[n]) for n in first)  # one export per rollout id
    # outside the checkpoint: not in its manifest
    manifest = json.load(open(os.path.join(checkpoint.iter_dir(str(tmp_path / "ck"), 1), "checksums.json")))
    assert not any("export" in rel for rel in manifest.get("files", manifest))


# --- one FSDP2 rank: the sharded (DCP) save and load ------------------------------------------------------------


def dcp_worker(rank: int, world_size: int, argv: list[str], ports: list[int], out: str) -> None:
    """Two steps (with --reset-optimizer-states: every step count stays 1), a --no-save-optim save with --save-hf,
    then a load into a fresh trainer and one more step."""
    from helpers.dist_ranks import _trainer, save

    torch.set_num_threads(1)
    ckpt = os.path.join(out, "ck")
    t = _trainer(argv, rank, world_size, ports[0])
    vocab = t.model.cfg.vocab_size
    for k in range(2):
        t.train(k, step_batch(vocab, k))
    steps = sorted({float(s["step"]) for s in t.actor.optimizer.state.values()})
    at_save = t.full_state_dict()
    save(t, ckpt, 1)
    t.close()
    import torch.distributed.checkpoint as dcp

    keys = sorted(dcp.FileSystemReader(os.path.join(ckpt, "iter_0000001", "dist")).read_metadata().state_dict_metadata)
    t = _trainer(argv, rank, world_size, ports[1])  # a second group: its own port
    start = t.load(ckpt) + 1
    loaded = t.full_state_dict()
    empty = t.actor.optimizer.state_dict()["state"] == {}
    t.train(start, step_batch(vocab, start))
    after = sorted({float(s["step"]) for s in t.actor.optimizer.state.values()})
    torch.save(
        {"steps": steps, "keys": keys, "at_save": at_save, "loaded": loaded, "empty": empty, "after": after},
        os.path.join(out, f"rank{rank}.pt"),
    )
    t.close()


@pytest.mark.slow
def test_one_fsdp2_rank_resets_saves_without_optimizer_and_exports_hf(tiny_ckpt, addition_data, tmp_path, caplog):
    template = str(tmp_path / "export" / "{rollout_id}")
    argv = trainer_argv(
        tiny_ckpt, addition_data, str(tmp_path / "o"), "--reset-optimizer-states", "--no-save-optim", "--save-hf",
        template, "--save", str(tmp_path / "ck"),
    )  # fmt: skip
    run_ranks(dcp_worker, 1, argv, free_ports(2), str(tmp_path))
    r = torch.load(tmp_path / "rank0.pt", weights_only=True)
    assert r["steps"] == [1.0]  # reset before step 1's training: a DTensor state zeroed in place
    assert not any(k.startswith("optimizer.") for k in r["keys"]) and "opt_step" in r["keys"]
    assert r["empty"] and r["after"] == [1.0]
    assert all(torch.equal(r["loaded"][n], w) for n, w in r["at_save"].items())
    exported = load_hf_state_dict(str(tmp_path / "export" / "1"))
    assert all(torch.equal(exported[n], w) for n, w in r["at_save"].items())


# --- --ci-train-rollout-logprob-abs-diff-threshold ---------------------------------------------------------------


def test_logprob_bound_stops_the_step_naming_step_value_and_flag(tiny_ckpt, addition_data, tmp_path):
    flag = "--ci-train-rollout-logprob-abs-diff-threshold"
    strict = make_actor(tiny_ckpt, addition_data, tmp_path / "a", flag, "0.1")
    # ragged_samples' engine log-probs are all -2.0: far from the tiny model's
    with pytest.raises(RunError) as e:
        strict.train(4, _groups(strict, 0))
    message = str(e.value)
    assert message.startswith("step 5: train/train_rollout_logprob_abs_diff = ") and f"exceeds {flag} 0.1" in message
    assert "\n" not in message
    loose = make_actor(tiny_ckpt, addition_data, tmp_path / "b", flag, "100")
    assert loose.train(0, _groups(loose, 0))["train/train_rollout_logprob_abs_diff"] > 0.1


def shift_rollout_log_probs(args, sample):
    """A sample hook that moves the engine's log-probs by 1: the mismatch a bound must catch."""
    sample.rollout_log_probs = [lp - 1.0 for lp in sample.rollout_log_probs]


def test_slime_ci_test_stops_a_run_past_slimes_default_bound_with_exit_1(tiny_ckpt, addition_data, tmp_path, capsys):
    argv = base_args(tiny_ckpt, addition_data, tmp_path / "r", "--num-rollout", "2", "--ci-test")
    hook = ["--rollout-sample-hook-path", "test_slime_optim_ckpt_flags.shift_rollout_log_probs"]
    assert main(argv + hook) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("lichen train: error:")]
    assert len(lines) == 1, err
    value = re.search(r"step 1: train/train_rollout_logprob_abs_diff = (\S+) exceeds", lines[0])
    assert value and float(value.group(1)) == pytest.approx(1.0, abs=1e-3), lines[0]
    assert "--ci-train-rollout-logprob-abs-diff-threshold 0.1" in lines[0]


# --- flags: checks and the slime table ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--save-hf", "out_{rollout_id}"], "no --save DIR is given"),
        (["--save", "S", "--save-hf", "out_{step}"], "{rollout_id} as its only field"),
        (["--save", "S", "--save-hf", "out_{rollout_id"], "{rollout_id} as its only field"),
        (["--save", "S", "--save-hf", "HF"], "is the --hf-checkpoint directory"),
        (["--ci-train-rollout-logprob-abs-diff-threshold", "-1"], "--ci-train-rollout-logprob-abs-diff-threshold"),
    ],
)
def test_flag_mistakes_are_one_config_error(tiny_ckpt, addition_data, tmp_path, extra, message):
    extra = [str(tmp_path / "s") if x == "S" else tiny_ckpt if x == "HF" else x for x in extra]
    argv = base_args(tiny_ckpt, addition_data, tmp_path / "o", "--num-rollout", "1", *extra)[1:]
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_train_args(argv)


def test_the_four_flags_are_lichens_in_the_slime_table():
    known = set(option_actions(build_train_parser()))
    assert set(FLAGS) <= known
    assert slime_compat.classify("--reset-optimizer-states", known).cls == SAME
    for flag in FLAGS[1:]:
        rule = slime_compat.classify(flag, known)
        assert rule.cls == DIFFERS_CLASS and rule.reason, flag
