"""--only-train-params-name-list / --freeze-params-name-list (slime's flags, lichen.train.param_filter): frozen
parameters keep their values bit for bit through training steps while the others change, on the single-rank
trainer, on 2 FSDP2 ranks (a decoder layer mixing frozen and trained parameters in one FSDP2 unit) and with
--use-lora (the patterns select adapters); a pattern that matches nothing is a usage error naming the flag."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from helpers.dist_ranks import config, free_port, rank_files, run_ranks, step_batch, trainer_argv

from lichen.config import parse_train_args
from lichen.errors import ConfigError
from lichen.train.actor import TrainActor
from lichen.train.dist_trainer import DistTrainer

# one whole decoder layer frozen, and in the other only the attention's q projection: that layer is one FSDP2 unit
# holding frozen and trained parameters
FREEZE = ["--freeze-params-name-list", r"layers\.0\.", r"layers\.1\.self_attn\.q_proj", "embed_tokens"]


def _snapshot(named) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in named}


def _assert_frozen_exactly(before: dict, after: dict, frozen: set[str]) -> None:
    assert frozen and frozen < set(before)
    for name, w in before.items():
        if name in frozen:
            assert torch.equal(after[name], w), f"{name} is frozen but changed"
        else:
            assert not torch.equal(after[name], w), f"{name} trains but did not change"


def _frozen_names(names, patterns: list[str], only_train: bool) -> set[str]:
    hit = {n for n in names if any(re.search(p, n) for p in patterns)}
    return set(names) - hit if only_train else hit


def _train(actor: TrainActor, steps: int) -> None:
    vocab = actor.model.cfg.vocab_size
    for k in range(steps):
        actor.train(k, step_batch(vocab, k))


@pytest.mark.parametrize(
    "flags, only_train",
    [(FREEZE, False), (["--only-train-params-name-list", r"mlp\.(up|down)_proj", r"^model\.norm\."], True)],
    ids=["freeze", "only_train"],
)
def test_frozen_parameters_are_bit_identical_after_training(tiny_ckpt, addition_data, tmp_path, flags, only_train):
    cfg, args = config(trainer_argv(tiny_ckpt, addition_data, str(tmp_path / "o"), *flags))
    actor = TrainActor(cfg, plugin_args=args)
    before = _snapshot(actor.model.named_parameters())
    frozen = _frozen_names(before, flags[1:], only_train)
    assert set(actor.frozen_params) == frozen
    in_optimizer = {id(p) for group in actor.optimizer.param_groups for p in group["params"]}
    params = dict(actor.model.named_parameters())
    assert in_optimizer == {id(p) for n, p in params.items() if n not in frozen}  # frozen: no optimizer state
    _train(actor, 2)
    _assert_frozen_exactly(before, _snapshot(actor.model.named_parameters()), frozen)
    # what weight sync sends: frozen tensors as loaded, trained ones as trained
    sent = dict(actor.named_weights())
    assert all(torch.equal(sent[n], before[n]) for n in frozen)


def freeze_worker(rank: int, world_size: int, argv: list[str], port: int, out: str) -> None:
    """Full weights before and after 2 steps, and which parameters the rank's optimizer holds."""
    torch.set_num_threads(1)
    cfg, args = config(argv)
    t = DistTrainer(cfg, args, rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port)
    before = t.full_state_dict()
    held = {id(p) for group in t.actor.optimizer.param_groups for p in group["params"]}
    trained = sorted(n for n, p in t.model.named_parameters() if id(p) in held)
    no_grad = sorted(n for n, p in t.model.named_parameters() if not p.requires_grad)
    for k in range(2):
        t.train(k, step_batch(t.model.cfg.vocab_size, k))
    after = t.full_state_dict()
    torch.save(
        {"before": before, "after": after, "trained": trained, "no_grad": no_grad}, os.path.join(out, f"rank{rank}.pt")
    )
    t.close()


@pytest.mark.slow
def test_two_fsdp2_ranks_keep_frozen_parameters_and_match_one_rank(tiny_ckpt, addition_data, tmp_path):
    """FSDP2 shards a decoder layer with frozen and trained parameters as one unit (mixed requires_grad): the
    frozen ones keep their values, the rest match the single-rank trainer's update."""
    argv = trainer_argv(tiny_ckpt, addition_data, str(tmp_path / "o"), *FREEZE)
    run_ranks(freeze_worker, 2, argv, free_port(), str(tmp_path))
    ranks = rank_files(tmp_path, 2)
    cfg, args = config(argv)
    local = TrainActor(cfg, plugin_args=args)
    frozen = set(local.frozen_params)
    for r in ranks:  # each rank's optimizer holds exactly its shards of the trained parameters
        assert set(r["no_grad"]) == frozen and not frozen & set(r["trained"])
    _assert_frozen_exactly(ranks[0]["before"], ranks[0]["after"], frozen)
    _train(local, 2)
    for name, w in local.model.named_parameters():
        assert torch.allclose(ranks[0]["after"][name], w.detach(), rtol=0, atol=1e-5), name


LORA = ["--use-lora", "--lora-rank", "4", "--lora-alpha", "8", "--lr", "0.02"]


def test_with_lora_the_patterns_select_adapters(tiny_ckpt, addition_data, tmp_path):
    """--use-lora: the base weights are frozen already; the patterns choose among the adapters (here: layer 1's
    only), so layer 0's adapters keep their initial values and no base weight moves."""
    flags = ["--only-train-params-name-list", r"layers\.1\..*lora_"]
    cfg, args = config(trainer_argv(tiny_ckpt, addition_data, str(tmp_path / "o"), *LORA, *flags))
    actor = TrainActor(cfg, plugin_args=args)
    before = _snapshot(actor.model.named_parameters())
    adapters = {n for n in before if ".lora_" in n}
    trained = {n for n in adapters if re.search(flags[1], n)}
    assert trained and trained < adapters
    assert set(actor.frozen_params) == adapters - trained
    _train(actor, 2)
    after = _snapshot(actor.model.named_parameters())
    for name, w in before.items():
        assert torch.equal(after[name], w) == (name not in trained), name


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--freeze-params-name-list", "embed", "no_such_param"], "--freeze-params-name-list: 'no_such_param' matches"),
        (["--only-train-params-name-list", "nothing_to_train"], "--only-train-params-name-list: 'nothing_to_train'"),
    ],
)
def test_a_pattern_matching_no_parameter_is_refused_naming_the_flag(tiny_ckpt, addition_data, tmp_path, flags, message):
    cfg, args = config(trainer_argv(tiny_ckpt, addition_data, str(tmp_path / "o"), *flags))
    with pytest.raises(ConfigError, match=re.escape(message)):
        TrainActor(cfg, plugin_args=args)


def test_lora_pattern_matching_no_adapter_is_refused(tiny_ckpt, addition_data, tmp_path):
    """With --use-lora a base weight's name is not an adapter's: refused, saying the patterns select adapters."""
    flags = ["--freeze-params-name-list", r"embed_tokens"]
    cfg, args = config(trainer_argv(tiny_ckpt, addition_data, str(tmp_path / "o"), *LORA, *flags))
    with pytest.raises(ConfigError, match="select among the adapters"):
        TrainActor(cfg, plugin_args=args)


def test_freezing_everything_is_refused(tiny_ckpt, addition_data, tmp_path):
    cfg, args = config(trainer_argv(tiny_ckpt, addition_data, str(tmp_path / "o"), "--freeze-params-name-list", "."))
    with pytest.raises(ConfigError, match="nothing would train"):
        TrainActor(cfg, plugin_args=args)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--freeze-params-name-list", "a", "--only-train-params-name-list", "b"], "exclude each other"),
        (["--freeze-params-name-list", "layers.(0"], "--freeze-params-name-list: 'layers.(0' is not a Python regular"),
    ],
)
def test_flag_mistakes_are_refused_when_parsing(tiny_ckpt, addition_data, tmp_path, flags, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_train_args(trainer_argv(tiny_ckpt, addition_data, str(tmp_path / "o"), *flags))


@pytest.mark.slow
def test_cli_exits_2_naming_the_flag(tiny_ckpt, addition_data, tmp_path):
    """The whole `lichen train` run: one line naming the flag and the pattern, exit code 2, no traceback."""
    argv = trainer_argv(tiny_ckpt, addition_data, str(tmp_path / "o"), "--freeze-params-name-list", "no_such_param")
    proc = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "lichen"), "train", *argv],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.abspath(__file__))},  # loop_plugins
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: --freeze-params-name-list: 'no_such_param' matches no model parameter" in proc.stderr
    assert "Traceback" not in proc.stderr
