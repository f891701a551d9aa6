"""Where lichen keeps slime's flag name but not slime's behaviour: each difference is listed in the flag table's
"differs" column (lichen.config.slime_flags.DIFFERS, docs/slime-compat.md) and pinned here, so a change to either
side is a decision, not an accident."""

from __future__ import annotations

import torch

from lichen.algo.advantages import whiten
from lichen.algo.losses import value_loss
from lichen.config import parse_train_args
from lichen.config.slime_flags import DIFFERS
from lichen.rewards.dapo import extract_dapo_answer
from lichen.rewards.deepscaler import grade_deepscaler
from lichen.rewards.gpqa import choice_letters
from lichen.rewards.math_grader import grade_math
from lichen.rollout.eval import is_correct, pass_k_values
from lichen.types import Sample, Status


def test_math_and_deepscaler_grade_an_unboxed_last_number():
    assert "unboxed" in DIFFERS["--rm-type"]
    assert grade_math("so the total is 42", "42") == 1.0  # slime: 0 without \boxed
    assert grade_deepscaler("<think>...</think> the total is 42", "42") == 1.0


def test_gpqa_defaults_to_four_letters():
    assert "A-D" in DIFFERS["--rm-type"]
    assert choice_letters(None) == "ABCD"  # slime: A-J


def test_dapo_reads_the_last_answer_anywhere():
    assert "300 characters" in DIFFERS["--rm-type"]
    assert extract_dapo_answer("Answer: 5\n" + "x" * 400) == "5"  # slime looks at the last 300 characters only


def test_pass_at_k_counts_positive_rewards_and_adds_k_equal_n():
    assert "reward > 0" in DIFFERS["--eval-prompt-data"]
    sample = Sample(prompt="p", response="r", reward=0.5, status=Status.COMPLETED)
    assert is_correct(sample, None)  # slime: only reward == 1
    assert pass_k_values(3) == [1, 2, 3]  # k = n = 3 is reported too


def test_value_loss_has_a_half_factor_and_whitening_the_population_variance():
    assert "0.5 factor" in DIFFERS["--advantage-estimator"]
    loss = value_loss(torch.tensor([2.0]), torch.tensor([0.0]), torch.tensor([0.0]))
    assert loss.item() == 2.0  # 0.5 * (2 - 0)^2
    w = whiten(torch.tensor([1.0, 3.0]), torch.tensor([1.0, 1.0]), eps=0.0)
    assert torch.allclose(w, torch.tensor([-1.0, 1.0]))  # var = 1 (population), not 2 (sample)


def test_offload_with_no_offload_train_keeps_the_rollout_offload(tmp_path, monkeypatch):
    assert "--no-offload-train" in DIFFERS and "--offload" in DIFFERS
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    args = parse_train_args(["--hf-checkpoint", "hf", "--prompt-data", "p.jsonl", "--rollout-batch-size", "2",
                             "--rm-type", "math", "--num-rollout", "1", "--offload", "--no-offload-train",
                             "--advantage-estimator", "ppo"])
    assert args.offload_train is False and args.offload_rollout is True  # slime forces --offload-train for PPO


def test_weight_decay_defaults_to_zero_and_decays_one_dimensional_weights_too():
    from lichen.config import build_train_parser
    from lichen.train.optim import make_adamw

    assert "norm weights and biases too" in DIFFERS["--weight-decay"] and "slime 0.01" in DIFFERS["--weight-decay"]
    assert {a.dest: a.default for a in build_train_parser()._actions}["weight_decay"] == 0.0
    norm_weight = torch.nn.Parameter(torch.ones(3))  # 1-D like a norm weight or a bias: Megatron does not decay it
    opt = make_adamw([norm_weight], lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.5)
    norm_weight.grad = torch.zeros(3)
    opt.step()
    assert torch.allclose(norm_weight.detach(), torch.full((3,), 0.95))  # decayed by lr * wd


def test_train_env_vars_are_set_in_lichens_own_process(tmp_path, monkeypatch, capsys):
    """lichen sets --train-env-vars in its process, so the engine servers it launches inherit them (slime: the
    training actors only)."""
    import os

    import lichen.cli

    assert "engines lichen launches" in DIFFERS["--train-env-vars"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LICHEN_TEST_ENV_X", "")  # recorded as absent before: the run's setting is undone after the test
    monkeypatch.delenv("LICHEN_TEST_ENV_X")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the test's own copy, restored afterwards
    rc = lichen.cli.main(["train", "--hf-checkpoint", "hf", "--prompt-data", "p.jsonl", "--rollout-batch-size", "2",
                          "--n-samples-per-prompt", "2", "--rm-type", "math", "--num-rollout", "1", "--train-env-vars",
                          '{"LICHEN_TEST_ENV_X": "1"}', "--dry-run"])
    assert rc == 0 and os.environ["LICHEN_TEST_ENV_X"] == "1"
