"""benchmarks/async_learning.py: the paired sync / --async comparison on the quick-start task (docs/async.md)."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import async_learning  # noqa: E402


def _row(seed, sync_gain, async_gain, staleness):
    return {
        "seed": seed,
        "sync_curve": [(0, 0.5), (2, 0.5 + sync_gain / 100)],
        "sync_gain": sync_gain,
        "async_gain": async_gain,
        "diff": async_gain - sync_gain,
        "staleness_max": staleness,
        "staleness_mean": [float(s) for s in staleness],
    }


def test_report_pairs_the_seeds_and_counts_staleness(capsys):
    summary = async_learning.report(
        [_row(1, 10.0, 8.0, [0, 1, 1]), _row(2, 12.0, 13.0, [0, 1, 1]), _row(3, 9.0, 9.0, [0, 1, 1])]
    )
    ci = summary["ci"]
    assert summary["diffs"] == [-2.0, 1.0, 0.0] and ci["mean"] == pytest.approx(-1 / 3)
    # sd of (-2, 1, 0) = sqrt(7/3); t(0.975, 2 dof) = 4.303
    half = 4.3027 * (7 / 3) ** 0.5 / 3**0.5
    assert ci["lower"] == pytest.approx(-1 / 3 - half, abs=1e-3) and ci["upper"] == pytest.approx(
        -1 / 3 + half, abs=1e-3
    )
    assert summary["staleness_max_hist"] == {"0": 3, "1": 6} and summary["staleness_mean"] == pytest.approx(2 / 3)
    assert "NOT met" in capsys.readouterr().out  # the lower bound is below -3 points


@pytest.mark.slow
def test_one_tiny_seed_runs_both_modes_from_one_sft_start(tmp_path):
    assert async_learning.main(["--seeds", "1", "--tiny", "--workdir", str(tmp_path)]) == 0
    summary = json.load(open(tmp_path / "summary.json"))
    (row,) = summary["rows"]
    assert row["sync_curve"][0] == row["async_curve"][0]  # the same SFT start, evaluated greedily
    assert [s for s in row["staleness_max"]] == [0, 1]  # rollout 1 made with version 0
    for mode in ("sync", "async"):
        config = json.load(open(tmp_path / "seed1" / f"rl_{mode}" / "config.json"))
        assert config["async_train"] == (mode == "async") and config["rollout_num_engines"] == 1
