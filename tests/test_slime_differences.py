"""lichen's flags of slime's name against slime's meaning, one test per difference the slime-compatibility issue
found. Aligned ones pin slime's meaning against a reference written from slime's code (expected values derived by
hand, never by calling lichen); the ones kept are class "differs" in the flag table, with lichen's behaviour pinned,
so a change to either side is a decision, not an accident."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from lichen.algo.advantages import whiten
from lichen.algo.losses import value_loss
from lichen.config import build_train_parser, parse_train_args
from lichen.config.engine_config import EngineConfig
from lichen.config.slime.flags import DIFFERS_CLASS, SAME, differs_note
from lichen.rewards import grade
from lichen.rewards.gpqa import choice_letters
from lichen.rollout.eval import eval_metrics, pass_k_values
from lichen.train.lr_schedule import lr_at
from lichen.train.optim import make_adamw
from lichen.types import Sample, Status


@pytest.fixture
def base(tmp_path, monkeypatch) -> list[str]:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 256,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": 102,
                "max_position_embeddings": 512,
            }
        )
    )
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    return [
        "--hf-checkpoint",
        "hf",
        "--prompt-data",
        "p.jsonl",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--num-rollout",
        "1",
    ]


def row(base: list[str], *extra: str, flag: str):
    """The table row of `flag` for `lichen train` with slime's table (a Megatron flag makes it print)."""
    args = parse_train_args(base + ["--rm-type", "math", "--use-mcore-models", *extra], show_table=lambda _t: None)
    return next(r for r in args._slime_rows if r.flag == flag)


# ------------------------------------------------------------------------------------------- aligned with slime


def test_math_and_deepscaler_grade_the_last_boxed_answer_only(base):
    # slime's grade_answer_verl / get_deepscaler_rule_based_reward: no \boxed, no answer
    assert grade("math", "so the total is 42", "42") == 0.0
    assert grade("math", r"so the total is \boxed{42}", "42") == 1.0
    assert grade("deepscaler", "<think>hm</think> the total is 42", "42") == 0.0
    assert grade("deepscaler", r"###Response the total is \boxed{42}", "42") == 1.0  # slime's ###Response fallback
    # lichen's lenient grading keeps its own names
    assert grade("math_lenient", "so the total is 42", "42") == 1.0
    assert grade("deepscaler_lenient", "<think>hm</think> the total is 42", "42") == 1.0
    math_row = row(base, flag="--rm-type")
    assert math_row.cls == DIFFERS_CLASS and "math-verify" in math_row.note  # the equivalence engine is lichen's


def test_gpqa_letters_and_labels_as_slime():
    assert choice_letters(None) == "ABCDEFGHIJ"  # slime's DEFAULT_VALID_LETTERS
    assert choice_letters({"valid_letters": ["a", "b", "c"]}) == "ABC"
    meta = {"choices": ["red", "green", "light blue"]}
    assert grade("gpqa", "The answer is C", "Light-Blue", meta) == 1.0  # labels fold [^a-z0-9]+ to a space
    assert grade("gpqa", "The answer is C", 2.0, {}) == 1.0  # a numeric label is an index
    assert grade("gpqa", "The answer is B", "x", {"correct_letter": "b"}) == 1.0


def test_dapo_reads_only_the_last_300_characters():
    # slime's compute_score: solution_str[-300:]
    assert grade("dapo", "Answer: 5\n" + "x" * 400, "5")["score"] == -1.0
    assert grade("dapo", "x" * 400 + "\nAnswer: 5", "5")["score"] == 1.0


def test_pass_at_k_counts_reward_one_and_reports_powers_of_two():
    # slime's compute_pass_rate: correct = (reward == 1); k = 2**i <= group size; unbiased estimator
    assert pass_k_values(3) == [1, 2] and pass_k_values(4) == [1, 2, 4]
    group = [Sample(reward=r, status=Status.COMPLETED) for r in (1.0, 0.5, 0.0)]
    m = eval_metrics([group], None)
    assert m["pass@1"] == pytest.approx(1 / 3)  # 0.5 is not a pass
    assert m["pass@2"] == pytest.approx(1 - math.comb(2, 2) / math.comb(3, 2))
    assert "pass@3" not in m


def test_whitening_uses_the_sample_variance():
    # slime's distributed_masked_whiten: var * n / (n - 1) for n >= 2
    values = torch.tensor([1.0, 3.0, 8.0])
    want = (values - values.mean()) / torch.sqrt(values.var(unbiased=True) + 1e-8)
    torch.testing.assert_close(whiten(values, torch.ones(3)), want)
    assert whiten(torch.tensor([5.0]), torch.ones(1)).item() == 0.0  # one entry: no correction, no division by 0


def test_value_loss_has_no_half_factor():
    # slime's value_loss_function: max((clip(v) - R)^2, (v - R)^2), no 0.5
    loss = value_loss(torch.tensor([2.0]), torch.tensor([2.0]), torch.tensor([0.0]), value_clip=0.2)
    assert loss.item() == 4.0


def test_offload_turns_both_on_even_with_an_explicit_no(base):
    # slime: `if args.offload: args.offload_train = args.offload_rollout = True`
    args = parse_train_args(base + ["--rm-type", "math", "--offload", "--no-offload-train"])
    assert args.offload_train is True and args.offload_rollout is True
    assert row(base, "--offload", flag="--offload").cls == SAME


def test_weight_decay_skips_biases_and_norm_weights():
    # Megatron's default no_weight_decay_cond: name.endswith(".bias") or len(param.shape) == 1
    matrix, vector = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(3))
    opt = make_adamw([matrix, vector], lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.5)
    matrix.grad, vector.grad = torch.zeros(2, 2), torch.zeros(3)
    opt.step()
    assert torch.allclose(matrix.detach(), torch.full((2, 2), 0.95))  # decayed by lr * wd
    assert torch.equal(vector.detach(), torch.ones(3))  # not decayed


# ----------------------------------------------------------------------------------- kept: class "differs"


def test_warm_up_ramps_as_megatron():
    # Megatron's OptimizerParamScheduler: lr = max_lr * num_steps / warmup_steps while num_steps <= warmup_steps,
    # num_steps counting the optimizer steps already taken (0 for the first)
    assert [lr_at(k, lr=1.0, min_lr=0.0, warmup=4, decay_iters=8, style="linear") for k in range(6)] == [
        0.0,
        0.25,
        0.5,
        0.75,
        1.0,
        0.75,
    ]


def test_weight_decay_and_lr_decay_style_given_are_slimes_left_out_differ(base):
    assert row(base, "--weight-decay", "0.1", flag="--weight-decay").cls == SAME
    assert row(base, "--lr-decay-style", "cosine", flag="--lr-decay-style").cls == SAME
    defaults = {a.dest: a.default for a in build_train_parser()._actions}
    assert defaults["weight_decay"] == 0.0  # Megatron: 0.01
    assert defaults["lr_decay_style"] == "constant"  # Megatron: linear
    wd, style = row(base, flag="--weight-decay"), row(base, flag="--lr-decay-style")  # a slime script without them
    assert wd.cls == style.cls == DIFFERS_CLASS and wd.values == style.values == []
    assert "slime 0.01" in wd.note and "slime linear" in style.note


def test_ppo_does_not_force_offload_train(base):
    # slime: `if args.use_critic: args.offload_train = True`
    args = parse_train_args(base + ["--rm-type", "math", "--advantage-estimator", "ppo"])
    assert args.offload_train is False
    ppo = row(base, "--advantage-estimator", "ppo", flag="--advantage-estimator")
    assert ppo.cls == DIFFERS_CLASS and "--offload-train" in ppo.note
    assert row(base, "--advantage-estimator", "grpo", flag="--advantage-estimator").cls == SAME


def test_train_env_vars_are_set_in_lichens_own_process(base, monkeypatch):
    """With --runtime local lichen sets --train-env-vars in its own process, so the engine servers it launches
    inherit them (slime: the training actors only)."""
    import lichen.cli

    monkeypatch.setattr(os, "environ", dict(os.environ))  # the test's own copy, restored afterwards
    os.environ.pop("LICHEN_TEST_ENV_X", None)
    rc = lichen.cli.main(
        ["train", *base, "--rm-type", "math", "--train-env-vars", '{"LICHEN_TEST_ENV_X": "1"}', "--dry-run"]
    )
    assert rc == 0 and os.environ["LICHEN_TEST_ENV_X"] == "1"
    assert row(base, "--train-env-vars", "{}", flag="--train-env-vars").cls == DIFFERS_CLASS
    assert differs_note("--train-env-vars", ["{}"], local=False) == ""  # --runtime ray: slime's meaning


def test_colocate_in_the_local_runtime_only_turns_the_offloads_on(base):
    """The table's note: with --runtime local the launched engines use the trainer's device whether or not
    --colocate is given (slime places them on other GPUs without it); --colocate turns both offloads on."""
    engines = ["--rm-type", "math", "--rollout-num-engines", "2", "--device", "cpu"]
    apart, together = parse_train_args(base + engines), parse_train_args(base + engines + ["--colocate"])
    assert EngineConfig.from_args(apart).device == EngineConfig.from_args(together).device == apart.device
    assert (apart.offload_train, apart.offload_rollout) == (False, False)
    assert (together.offload_train, together.offload_rollout) == (True, True)
    assert row(base, "--colocate", flag="--colocate").cls == DIFFERS_CLASS
    assert differs_note("--colocate", [], local=False) == ""  # --runtime ray: slime's layout


@pytest.mark.parametrize("layers", [2, 3])
def test_moe_aux_loss_coeff_weighs_the_hf_modules_pooled_loss(base, tmp_path, layers):
    """lichen weighs the transformers module's load-balancing loss, router statistics pooled over every MoE layer:
    a uniform router gives top-k whatever the layer count (Megatron sums one loss per layer normalised by top-k:
    1 per layer)."""
    from lichen.models.loading import load_model
    from lichen.models.tiny import make_tiny_model

    assert row(base, "--moe-aux-loss-coeff", "0.01", flag="--moe-aux-loss-coeff").cls == DIFFERS_CLASS
    ckpt = make_tiny_model(
        str(tmp_path / "moe"),
        arch="qwen3_moe",
        hidden_size=32,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=48,
        max_position_embeddings=64,
    )
    model = load_model(ckpt, impl="hf")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.zero_()  # every expert equally likely for every token
    with model.recording_router_logits():
        model(torch.tensor([[5, 6, 7, 8]]), torch.arange(4)[None])
    assert float(model.router_aux_loss(torch.ones((1, 4))).detach()) == model.hf.num_experts_per_tok == 2
