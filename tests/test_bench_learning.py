"""`lichen bench learning`: the t quantile and paired CI against closed forms and hand-computed values, the
window means and targets, the SFT flags lichen resolves, and a smoke run of the whole suite (SFT warm start, then
lichen and TRL on 2 seeds x 3 steps of the tiny `smoke` workload)."""

from __future__ import annotations

import json
import math

import pytest

from lichen.errors import ConfigError
from lichen_bench import learning
from lichen_bench.workloads import WORKLOADS


# ---- statistics ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [0.6, 0.9, 0.975, 0.995])
def test_t_quantile_matches_closed_forms_for_1_and_2_dof(p):
    # dof 1 is the Cauchy distribution: t_p = tan(pi (p - 1/2)); dof 2: t_p = (2p - 1) / sqrt(2 p (1 - p))
    assert learning.t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9)
    assert learning.t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-9)


@pytest.mark.parametrize(
    "dof,expected", [(3, 3.182446), (4, 2.776445), (5, 2.570582), (9, 2.262157), (30, 2.042272), (120, 1.979930)]
)
def test_t_quantile_matches_printed_tables(dof, expected):
    assert learning.t_quantile(0.975, dof) == pytest.approx(expected, abs=2e-6)


def test_t_mass_is_a_distribution_against_numeric_integration():
    # P(|T| <= 1.5) for dof 4 and 7 by Simpson's rule on the density, in float64
    for dof in (4, 7):
        c = math.gamma((dof + 1) / 2) / (math.sqrt(dof * math.pi) * math.gamma(dof / 2))
        pdf = lambda x: c * (1 + x * x / dof) ** (-(dof + 1) / 2)  # noqa: E731
        n, h = 2000, 1.5 / 2000
        simpson = h / 3 * sum((1 if i in (0, n) else 4 if i % 2 else 2) * pdf(i * h) for i in range(n + 1))
        assert learning.t_two_sided_mass(1.5, dof) == pytest.approx(2 * simpson, abs=1e-10)
    assert learning.t_two_sided_mass(0.0, 5) == 0.0 and learning.t_two_sided_mass(1e6, 6) == pytest.approx(1.0)


def test_paired_ci_against_a_hand_computed_value():
    # d = [0.10, -0.02, 0.05, 0.00, 0.07]: mean 0.04; squared deviations .0036 + .0036 + .0001 + .0016 + .0009 =
    # .0098, sd = sqrt(.0098 / 4) = 0.0494975; se = sd / sqrt 5 = 0.0221359; t_0.975,4 = 2.776445 (table);
    # half width 0.0614592 -> [-0.0214592, 0.1014592]
    ci = learning.paired_ci([0.10, -0.02, 0.05, 0.00, 0.07])
    assert ci["n"] == 5 and ci["mean"] == pytest.approx(0.04)
    assert ci["sd"] == pytest.approx(0.0494975, abs=1e-7)
    assert ci["half_width"] == pytest.approx(0.0614592, abs=1e-6)
    assert (ci["lower"], ci["upper"]) == (pytest.approx(-0.0214592, abs=1e-6), pytest.approx(0.1014592, abs=1e-6))
    with pytest.raises(ValueError):
        learning.paired_ci([0.1])


def test_windows_and_targets():
    assert learning.window_mean([0.0, 1.0, 0.5, None, 1.0], 1, 2) == 0.5
    assert learning.window_mean([0.0, 1.0, 0.5, None, 1.0], 3, 5) == 0.75  # the step with no reward is left out
    run = lambda curve: {  # noqa: E731
        "curve": curve,
        "early": learning.window_mean(curve, 1, 1),
        "late": learning.window_mean(curve, 2, 3),
    }
    seeds = [
        {"seed": 1, "lichen": run([0.1, 0.5, 0.7]), "trl": run([0.2, 0.5, 0.5])},  # diff +0.1
        {"seed": 2, "lichen": run([0.3, 0.4, 0.4]), "trl": run([0.3, 0.6, 0.4])},  # diff -0.1
        {"seed": 3, "lichen": {"error": "boom"}, "trl": run([0.0, 0.0, 0.0])},
    ]  # not paired
    res = learning.analyse(seeds)
    assert res["paired_seeds"] == [1, 2] and res["diffs"] == pytest.approx([0.1, -0.1])
    # mean 0, sd sqrt(0.02), t_0.975,1 = 12.7062: lower = -12.7062 * 0.1414214 / sqrt 2 = -1.27062
    assert res["ci"]["lower"] == pytest.approx(-1.270620, abs=1e-5)
    assert not res["target_ci"]["pass"]
    assert res["lichen_early"] == pytest.approx(0.2) and res["lichen_late"] == pytest.approx(0.5)
    assert res["target_improves"]["pass"]
    table = learning.format_table(seeds, res, 1, 2, 3)
    assert "target 1, CI lower bound >= -0.05: -1.2706  MISS" in table and "PASS" in table
    curves = learning.mean_curves(seeds, 3)
    assert curves["lichen"] == pytest.approx([0.2, 0.45, 0.55])
    assert curves["trl"] == pytest.approx([0.5 / 3, 1.1 / 3, 0.3])
    plot = learning.ascii_plot(curves, height=10)
    assert plot.splitlines()[1].startswith(" 1.0 |") and "step" in plot.splitlines()[-1]


def test_rejects_bad_windows_and_seed_counts():
    for argv in (
        ["--seeds", "1"],
        ["--steps", "3", "--late-from", "4"],
        ["--early-steps", "0"],
        ["--warm-start", "/nonexistent"],
    ):
        with pytest.raises(ConfigError):
            learning.main(argv + ["--skip-trl"])


def test_sft_flags_resolve_to_an_sft_run(tmp_path):
    from lichen.config import parse_train_args
    from lichen.models.tiny import make_tiny_model

    wl = WORKLOADS["smoke"]
    ckpt = tmp_path / "m"
    make_tiny_model(
        str(ckpt),
        hidden_size=wl.hidden_size,
        intermediate_size=wl.intermediate_size,
        num_layers=wl.num_layers,
        num_heads=wl.num_heads,
    )
    train, held, n_train = learning.write_sft_data(str(tmp_path), 40, seed=0)
    assert n_train == 40 * 40 - 40
    rows = [json.loads(x) for x in open(train)] + [json.loads(x) for x in open(held)]
    assert len({r["prompt"] for r in rows}) == 1600  # train and held-out are disjoint and cover the W1 range
    assert all(int(r["label"]) == sum(map(int, r["prompt"][:-1].split("+"))) for r in rows)
    a = learning.build_parser().parse_args(["--sft-steps", "7", "--sft-batch", "4", "--sft-lr", "3e-4"])
    flags = learning.sft_flags(wl, a, checkpoint=str(ckpt), train=train, heldout=held, out=str(tmp_path / "o"))
    args = parse_train_args(flags[1:])
    assert flags[0] == "train"
    assert (args.loss_type, args.rollout_function_path) == ("sft_loss", "lichen.rollout.sft.generate_rollout")
    assert (args.num_rollout, args.rollout_batch_size, args.n_samples_per_prompt, args.lr) == (7, 4, 1, 3e-4)
    assert args.eval_interval == 7 and args.eval_temperature == 0.0


# ---- the whole suite ----------------------------------------------------------------------------------------
@pytest.mark.slow  # 20 s on 2 idle cores: the largest of make test-fast
def test_suite_smoke_run(tmp_path, capsys):
    pytest.importorskip("trl")  # the CI needs both frameworks
    out = tmp_path / "r.json"
    rc = learning.main(
        [
            "--workload",
            "smoke",
            "--seeds",
            "2",
            "--steps",
            "3",
            "--early-steps",
            "1",
            "--sft-steps",
            "2",
            "--sft-batch",
            "4",
            "--sft-heldout",
            "8",
            "--threads",
            "1",
            "--jobs",
            "4",
            "--work-dir",
            str(tmp_path / "w"),
            "--out-json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "lichen - TRL, mean reward steps 2-3: " in text and "95% CI [" in text
    assert "target 1, CI lower bound >= -0.05" in text and "target 2, lichen mean reward" in text
    rep = json.loads(out.read_text())
    assert rep["errors"] == [] and rep["result"]["paired_seeds"] == [1, 2]
    assert rep["sft"]["heldout_accuracy"] is not None and rep["sft"]["checkpoint"].endswith("hf")
    for s in rep["seeds"]:
        for fw in ("lichen", "trl"):
            curve = s[fw]["curve"]
            assert len(curve) == 3 and all(0.0 <= x <= 1.0 for x in curve)
            assert s[fw]["late"] == pytest.approx(sum(curve[1:]) / 2)
    assert rep["result"]["diffs"] == pytest.approx([s["lichen"]["late"] - s["trl"]["late"] for s in rep["seeds"]])
    # both frameworks read the same per-seed prompt file, and seeds differ
    p1, p2 = (tmp_path / "w" / "runs-001" / f"seed{s}" / "prompts.jsonl" for s in (1, 2))
    assert p1.read_text() != p2.read_text()


@pytest.mark.slow
def test_reused_work_dir_reports_its_own_curves(tmp_path, capsys):
    """A second invocation on the same --work-dir must not read the first one's metrics.jsonl (lichen appends)."""
    from lichen.models.tiny import make_tiny_model

    wl = WORKLOADS["smoke"]
    warm = tmp_path / "warm"
    make_tiny_model(
        str(warm),
        hidden_size=wl.hidden_size,
        intermediate_size=wl.intermediate_size,
        num_layers=wl.num_layers,
        num_heads=wl.num_heads,
    )
    reports = []
    for steps in (2, 3):
        out = tmp_path / f"r{steps}.json"
        rc = learning.main(
            [
                "--workload",
                "smoke",
                "--seeds",
                "2",
                "--steps",
                str(steps),
                "--early-steps",
                "1",
                "--warm-start",
                str(warm),
                "--skip-trl",
                "--threads",
                "1",
                "--jobs",
                "2",
                "--work-dir",
                str(tmp_path / "w"),
                "--out-json",
                str(out),
            ]
        )
        assert rc == 0, capsys.readouterr().err
        reports.append(json.loads(out.read_text()))
    assert [len(s["lichen"]["curve"]) for s in reports[1]["seeds"]] == [3, 3]
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["runs-001", "runs-002"]
