"""`lichen bench rl`: workload rewards, the FLOP model, run summaries, the flags each framework gets, and a
smoke run of the harness plumbing (lichen: one step in a child process; TRL: one step in process, skipped when
trl is not installed)."""

from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest

from lichen_bench import limits, report
from lichen_bench.workloads import (
    WORKLOADS,
    make_prompts,
    model_shape,
    score_addition,
    score_digit_fraction,
    trl_reward_fn,
    write_prompts,
)

HAS_TRL = importlib.util.find_spec("trl") is not None


# ---- rewards and prompts ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "response,label,expected",
    [
        ("47", "47", 1.0),
        ("47abc", "47", 1.0),
        (" 47", "47", 1.0),
        ("470", "47", 0.0),
        ("4", "47", 0.0),
        ("x47", "47", 0.0),
        ("", "47", 0.0),
        ("47", "", 0.0),
    ],
)
def test_addition_reward_reads_leading_digits(response, label, expected):
    assert score_addition(response, label) == expected


def test_digit_fraction_reward_and_trl_signature():
    assert score_digit_fraction("a1b2", "") == 0.5
    assert score_digit_fraction("", "") == 0.0
    assert score_digit_fraction("999", "") == 1.0
    fn = trl_reward_fn("addition")
    assert fn(["1+2=", "1+2="], ["3!", "4"], label=["3", "3"]) == [1.0, 0.0]


def test_prompts_are_deterministic_sums_in_step_order():
    rows = make_prompts(WORKLOADS["w1"], steps=3)
    assert len(rows) == 3 * WORKLOADS["w1"].prompts_per_step
    assert rows == make_prompts(WORKLOADS["w1"], steps=3)
    for row in rows:
        a, b = row["prompt"].rstrip("=").split("+")
        assert int(row["label"]) == int(a) + int(b)
    w2 = make_prompts(WORKLOADS["w2"], steps=1)
    assert len({len(r["prompt"]) for r in w2}) > 1  # ragged prompt lengths


# ---- FLOP model ---------------------------------------------------------------------------------------------
SHAPE = {"hidden": 8, "intermediate": 12, "layers": 2, "q_dim": 8, "kv_dim": 4, "vocab": 10}


def _naive_forward_flops(shape, p, r):
    """Position by position, matrix by matrix: 2*m*n per [1, m] x [m, n] product."""
    h, i, q, kv, V = shape["hidden"], shape["intermediate"], shape["q_dim"], shape["kv_dim"], shape["vocab"]
    total = 0
    for t in range(p + r - 1):
        for _ in range(shape["layers"]):
            for m, n in ((h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)):
                total += 2 * m * n
            total += 2 * q * (t + 1) + 2 * q * (t + 1)  # scores over t+1 keys, then the weighted sum of values
        if t >= p - 1:
            total += 2 * h * V  # this position predicts a response token
    return total


@pytest.mark.parametrize("p,r", [(1, 1), (5, 3), (6, 8), (3, 0)])
def test_forward_flops_match_a_naive_count(p, r):
    assert limits.sequence_forward_flops(SHAPE, p, r) == _naive_forward_flops(SHAPE, p, r)
    assert limits.useful_tokens(p, r) == max(p + r - 1, 0)


def test_model_shape_of_w1_counts_4_2m_parameters(tmp_path):
    cfg = {
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 102,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = model_shape(str(tmp_path))
    # linear FLOPs per token = 2 x matmul parameters of the layers; plus the tied embedding = the 4.22M checkpoint
    body = limits.linear_flops_per_token(shape) // 2
    assert body + 102 * 256 == 4_222_720 - 9 * 256  # minus the 9 RMSNorm weight vectors


# ---- summaries ----------------------------------------------------------------------------------------------
def _step(step, gen, train, lengths, engine=None, engine_tok=None, train_tok=None, reward=0.5, grad_tok=None):
    return {
        "train_grad_tokens": grad_tok,
        "train_nograd_tokens": None if grad_tok is None else train_tok - grad_tok,
        "step_time": step,
        "generate_time": gen,
        "train_time": train,
        "engine_time": engine,
        "reward_mean": reward,
        "lengths": lengths,
        "engine_tokens": engine_tok,
        "train_tokens": train_tok,
    }


def test_summary_skips_the_warmup_step_and_divides_sums():
    steps = [
        _step(9.0, 5.0, 4.0, [[2, 1]], engine=4.0, engine_tok=99, train_tok=99, reward=0.0),  # warm-up, dropped
        _step(3.0, 1.0, 1.5, [[2, 2], [2, 4]], engine=0.5, engine_tok=12, train_tok=14, reward=0.25, grad_tok=10),
        _step(5.0, 3.0, 1.5, [[3, 1]], engine=1.5, engine_tok=4, train_tok=4, reward=1.0, grad_tok=3),
    ]
    s = report.summarize_run(steps, SHAPE, matmul_flops=1e9, peak_rss_kib=2048, wall_s=20.0)
    assert s["num_timed_steps"] == 2
    assert s["step_time_s"] == pytest.approx(4.0)
    assert s["step_time_median_s"] == pytest.approx(4.0) and s["step_time_min_s"] == 3.0
    assert s["generate_median_s"] == pytest.approx(2.0) and s["train_median_s"] == pytest.approx(1.5)
    assert s["generate_min_s"] == 1.0 and s["train_min_s"] == 1.5
    assert s["generate_s"] == pytest.approx(2.0) and s["train_s"] == pytest.approx(1.5)
    assert s["other_s"] == pytest.approx(0.5)
    assert s["response_tokens"] == pytest.approx(7 / 2)
    assert s["rollout_tokens_per_s"] == pytest.approx(7 / 8.0)
    assert s["engine_tokens_per_s"] == pytest.approx(7 / 2.0)
    assert s["engine_useful_positions"] == pytest.approx((3 + 5 + 3) / 2)
    assert s["engine_computed_positions"] == pytest.approx(8) and s["train_computed_positions"] == pytest.approx(9)
    flops = sum(_naive_forward_flops(SHAPE, p, r) for p, r in [[2, 2], [2, 4], [3, 1]])
    assert s["engine_gflops"] == pytest.approx(flops / 2.0 / 1e9)
    assert s["trainer_gflops"] == pytest.approx(3 * flops / 3.0 / 1e9)
    assert "trainer_matmul_frac" not in s  # useful FLOPs over the peak could read above 1 with prompt sharing
    # kernel efficiency over the computed positions: each step's useful FLOPs per useful position (p + r - 1)
    # x (3 x trained + no-grad positions), over the train time; and the prompt-sharing line, useful / trained
    step2 = (_naive_forward_flops(SHAPE, 2, 2) + _naive_forward_flops(SHAPE, 2, 4)) / (3 + 5) * (3 * 10 + 4)
    step3 = _naive_forward_flops(SHAPE, 3, 1) / 3 * (3 * 3 + 1)
    assert s["trainer_computed_gflops"] == pytest.approx((step2 + step3) / 3.0 / 1e9)
    assert s["trainer_computed_matmul_frac"] == pytest.approx((step2 + step3) / 3.0 / 1e9)
    assert s["train_useful_per_trained_position"] == pytest.approx(11 / 13)
    assert s["reward_curve"] == [0.0, 0.25, 1.0] and s["reward_mean"] == pytest.approx(1.25 / 3)
    assert s["peak_rss_mib"] == 2.0


def test_medians_and_ratios():
    runs = [{"step_time_s": x, "step_time_min_s": x / 2, "reward_curve": [x, 0.0]} for x in (3.0, 1.0, 2.0)]
    m = report.medians(runs)
    assert m["step_time_s"] == 2.0 and m["step_time_s_min"] == 1.0 and m["step_time_s_max"] == 3.0
    assert m["step_time_min_s"] == 0.5  # the fastest step of any repeat, not a median
    assert m["reward_curve"] == [2.0, 0.0]
    r = report.ratios({"step_time_s": 1.0, "train_s": 2.0}, {"step_time_s": 4.0, "train_s": 0})
    assert r == {"step_time_s": 0.25}
    table = report.format_table("w1", {"step_time_s": 1.0}, {"step_time_s": 4.0}, r)
    assert "0.250" in table and "step time" in table


# ---- the settings each framework gets -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def smoke_checkpoint(tmp_path_factory):
    from lichen.models.tiny import make_tiny_model

    wl = WORKLOADS["smoke"]
    d = tmp_path_factory.mktemp("bench")
    ckpt = d / "smoke" / "checkpoint"
    make_tiny_model(
        str(ckpt),
        hidden_size=wl.hidden_size,
        intermediate_size=wl.intermediate_size,
        num_layers=wl.num_layers,
        num_heads=wl.num_heads,
    )
    return d, ckpt


def test_lichen_flags_resolve_to_the_issue_settings(smoke_checkpoint, tmp_path):
    from lichen.config import parse_train_args
    from lichen_bench.rl import lichen_train_flags

    _, ckpt = smoke_checkpoint
    prompts = tmp_path / "p.jsonl"
    write_prompts(str(prompts), make_prompts(WORKLOADS["w1"], 20))
    args = parse_train_args(
        lichen_train_flags(
            WORKLOADS["w1"],
            checkpoint=str(ckpt),
            prompts=str(prompts),
            steps=20,
            seed=7,
            threads=2,
            output_dir=str(tmp_path / "o"),
            extra=[],
        )
    )
    expected = dict(
        lr=1e-4,
        eps_clip=0.2,
        eps_clip_high=0.2,
        loss_agg_mode="seq-mean-token-mean",
        advantage_estimator="grpo",
        clip_grad=1.0,
        num_steps_per_rollout=1,
        global_batch_size=32,
        use_kl_loss=False,
        kl_coef=0.0,
        rollout_temperature=1.0,
        rollout_top_p=1.0,
        rollout_top_k=-1,
        lr_decay_style="constant",
        lr_warmup_iters=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_eps=1e-8,
        num_threads=2,
        seed=7,
        rollout_batch_size=4,
        n_samples_per_prompt=8,
        rollout_max_response_len=8,
        num_rollout=20,
        bf16=False,
        rollout_shuffle=False,
        disable_grpo_std_normalization=False,
        entropy_coef=0.0,
    )
    assert {k: getattr(args, k) for k in expected} == expected


@pytest.mark.skipif(not HAS_TRL, reason="trl is not installed (pip install -e '.[bench]')")
def test_trl_config_sets_the_issue_settings(tmp_path):
    from trl import GRPOConfig

    from lichen_bench.run_trl import trl_config_kwargs

    cfg = GRPOConfig(**trl_config_kwargs(WORKLOADS["w1"], steps=20, seed=7, output_dir=str(tmp_path)))
    value = lambda x: getattr(x, "value", x)  # noqa: E731  (transformers stores enums)
    assert cfg.use_cpu and not cfg.bf16 and not cfg.gradient_checkpointing
    assert not getattr(cfg, "activation_checkpointing", False)  # transformers 5's new name for it
    assert value(cfg.lr_scheduler_type) == "constant" and cfg.warmup_steps == 0
    assert cfg.beta == 0.0 and cfg.loss_type == "grpo" and cfg.scale_rewards == "group"
    assert cfg.num_generations == 8 and cfg.per_device_train_batch_size == 32
    assert cfg.generation_batch_size == 32 and cfg.steps_per_generation == 1 and cfg.num_iterations == 1
    assert (cfg.epsilon, cfg.epsilon_high, cfg.max_grad_norm, cfg.learning_rate) == (0.2, 0.2, 1.0, 1e-4)
    assert (cfg.adam_beta1, cfg.adam_beta2, cfg.adam_epsilon, cfg.weight_decay) == (0.9, 0.999, 1e-8, 0.0)
    assert (cfg.temperature, cfg.top_p, cfg.top_k, cfg.max_completion_length) == (1.0, 1.0, 0, 8)
    assert cfg.report_to in ([], "none", ["none"]) and value(cfg.save_strategy) == "no"


@pytest.mark.skipif(not HAS_TRL, reason="trl is not installed (pip install -e '.[bench]')")
def test_trl_memory_config_accumulates_one_sample_micro_batches(tmp_path):
    """The memory baseline: the same 32-sample step, one generation, 32 accumulated one-sample backwards."""
    from trl import GRPOConfig

    from lichen_bench.run_trl import trl_config_kwargs

    cfg = GRPOConfig(**trl_config_kwargs(WORKLOADS["w1"], steps=2, seed=7, output_dir=str(tmp_path), grad_accum=32))
    assert (cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps) == (1, 32)
    assert cfg.generation_batch_size == 32 and cfg.steps_per_generation == 32 and cfg.num_generations == 8
    with pytest.raises(ValueError):
        trl_config_kwargs(WORKLOADS["w1"], steps=2, seed=7, output_dir=str(tmp_path), grad_accum=5)


# ---- smoke runs of the plumbing -----------------------------------------------------------------------------
def _check_run(run: dict, wl):
    assert run["num_steps"] == 1
    assert 0 < run["response_tokens"] <= wl.samples_per_step * wl.max_new_tokens
    # not >= useful: lichen's engine prefills a prompt once for all the samples that share it, and its trainer
    # lays a prompt out once per packed row for them (prompt sharing)
    assert run["engine_computed_positions"] > 0 and run["engine_useful_positions"] > 0
    assert run["train_computed_positions"] > 0 and run["train_useful_positions"] > 0
    assert run["step_time_s"] >= run["generate_s"] > 0 and run["train_s"] > 0
    assert len(run["reward_curve"]) == 1 and 0.0 <= run["reward_curve"][0] <= 1.0


@pytest.mark.slow
def test_harness_runs_one_lichen_step(smoke_checkpoint):
    from lichen_bench.rl import main

    work, _ = smoke_checkpoint
    out = work / "report.json"
    rc = main(
        [
            "--workload",
            "smoke",
            "--repeats",
            "1",
            "--steps",
            "1",
            "--skip-trl",
            "--skip-limits",
            "--work-dir",
            str(work),
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    rep = json.loads(out.read_text())
    res = rep["workloads"]["smoke"]
    assert res["errors"] == [] and res["runs"]["trl"] == []
    (run,) = res["runs"]["lichen"]
    _check_run(run, WORKLOADS["smoke"])
    assert run["instrumentation_missing"] == [] and run["torch_threads"] == 2
    assert run["peak_rss_mib"] > 50  # python + torch alone take more than this
    assert "--use-dynamic-batch-size" in res["lichen_flags"] and "--disable-zero-advantage-skip" in res["lichen_flags"]
    # equal work: no backward skipped; the skip variant (lichen's default) is its own run. The random-init smoke
    # model scores 0 everywhere, so every advantage is 0 and the variant skips all 4 backwards.
    (skip,) = res["runs"]["lichen_skip"]
    assert run["skipped_samples"] == 0 and skip["skipped_samples"] == WORKLOADS["smoke"].samples_per_step
    assert [c["when"] for c in res["loads"]] == ["before smoke", "after smoke"]


@pytest.mark.slow
def test_reused_work_dir_reports_its_own_runs(tmp_path, capsys):
    """A second invocation on the same --work-dir must not read the first one's metrics.jsonl (lichen appends)."""
    from lichen_bench.rl import main

    reports = []
    for steps in (1, 2):
        out = tmp_path / f"report{steps}.json"
        rc = main(
            [
                "--workload",
                "smoke",
                "--repeats",
                "1",
                "--steps",
                str(steps),
                "--skip-trl",
                "--skip-limits",
                "--no-skip-variant",
                "--work-dir",
                str(tmp_path / "work"),
                "--out",
                str(out),
            ]
        )
        assert rc == 0, capsys.readouterr().err
        reports.append(json.loads(out.read_text()))
    first, second = reports
    assert first["runs_dir"] != second["runs_dir"]
    (run,) = second["workloads"]["smoke"]["runs"]["lichen"]
    assert run["num_steps"] == 2 and len(run["reward_curve"]) == 2 and len(run["step_times"]) == 2


def test_load_above_the_cores_used_is_reported_loudly(monkeypatch, capsys):
    from lichen_bench import machine

    monkeypatch.setattr(machine.os, "getloadavg", lambda: (5.5, 3.0, 2.0))
    check = machine.load_check("bench", "before w2", 2)
    out = capsys.readouterr().out
    assert check["overloaded"] and check["loadavg"] == (5.5, 3.0, 2.0)
    assert "load average before w2: 5.50 3.00 2.00" in out and "WARNING" in out and "exceeds the 2 core(s)" in out
    assert machine.overloaded_summary([check]) == "load average exceeded the cores used: before w2 (5.50 > 2)"
    quiet = machine.load_check("bench", "after w2", 8)
    assert not quiet["overloaded"] and "WARNING" not in capsys.readouterr().out
    assert machine.overloaded_summary([quiet]) is None


@pytest.mark.skipif(not HAS_TRL, reason="trl is not installed (pip install -e '.[bench]')")
def test_trl_child_runs_one_step(smoke_checkpoint, tmp_path):
    from lichen_bench import run_trl

    _, ckpt = smoke_checkpoint
    wl = WORKLOADS["smoke"]
    prompts = tmp_path / "p.jsonl"
    write_prompts(str(prompts), make_prompts(wl, 1))
    result = tmp_path / "trl.json"
    rc = run_trl.main(
        [
            str(result),
            "--workload",
            "smoke",
            "--checkpoint",
            str(ckpt),
            "--prompts",
            str(prompts),
            "--steps",
            "1",
            "--output-dir",
            str(tmp_path / "out"),
        ]
    )
    assert rc == 0
    data = json.loads(result.read_text())
    assert data["instrumentation_missing"] == [] and data["torch_threads"] == 2
    steps = report.trl_steps(data)
    run = report.summarize_run(steps, model_shape(str(ckpt)), None, None, None)
    _check_run(run, wl)
    (step,) = data["steps"]
    assert len(step["lengths"]) == wl.samples_per_step
    # HF generate keeps every row until the last one finishes: prefill + one row per sample per extra token
    longest = max(r for _, r in step["lengths"])
    prompt_width = max(p for p, _ in step["lengths"])
    assert step["engine_tokens"] == wl.samples_per_step * (prompt_width + longest - 1)
    assert step["train_grad_tokens"] == wl.samples_per_step * (prompt_width + longest)
    assert not math.isnan(step["step_time"]) and os.path.isdir(tmp_path / "out")
