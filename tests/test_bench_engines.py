"""`lichen bench engines` (lichen serve vs vLLM): usage errors, the arithmetic on scripted rows, the quick mode end to
end with both servers (every printed number traced back to the JSON and the JSON to the runs' own metrics), and
lichen alone when vLLM's environment is missing."""

from __future__ import annotations

import json
import os
import re

import pytest
from helpers.vllm import vllm_python

from lichen.observe.metrics import read_metrics
from lichen_bench import engines as bench
from lichen_bench.engines_gen import summarize
from lichen_bench.engines_train import run_numbers

pytestmark = pytest.mark.e2e  # see the marker in pyproject.toml: make test leaves it to make test-e2e


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--cores", "x"], "--cores 'x': expected core ids"),
        (["--cores", "4096"], "--cores '4096': this process may use cores"),
        (["--sizes", "big"], "model 'big' (--gen-model / --sizes): expected w2 or a parameter count"),
        (["--tokens", "0"], "--tokens must be at least 1"),
    ],
)
def test_bad_values_are_one_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        bench.parse_args(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_quick_sets_its_sizes_unless_a_flag_is_given():
    args = bench.parse_args(["--quick", "--tokens", "5"])
    assert (args.tokens, args.prompts, args.sizes) == (5, bench.QUICK["prompts"], bench.QUICK["sizes"])
    assert "--vllm-optimization-level" in args.vllm_flags  # quick: no torch.compile
    assert "--vllm-optimization-level" not in bench.parse_args([]).vllm_flags  # full: vLLM's default


def test_run_numbers_and_summary_from_scripted_rows():
    rows = [
        {
            "time/sync": 2.0,
            "train/train_rollout_logprob_abs_diff": 1e-6,
            "train/train_rollout_logprob_abs_diff_max": 3e-6,
        },
        {
            "time/sync": 4.0,
            "train/train_rollout_logprob_abs_diff": 3e-6,
            "train/train_rollout_logprob_abs_diff_max": 9e-6,
        },
        {"eval/x": 1.0},
    ]
    got = run_numbers(rows)
    assert got["sync_s"] == 3.0 and got["sync_each_s"] == [2.0, 4.0]
    assert got["lp_diff_mean"] == pytest.approx(2e-6) and got["lp_diff_max"] == 9e-6
    assert run_numbers([{}])["sync_s"] is None
    s = summarize([float(i) for i in range(1, 11)], [2.0, 4.0], [100, 100], [1.0, 4.0])
    assert s["tok_s_each"] == [50.0, 25.0] and s["tok_s"] == 37.5 and s["tok_per_cpu_s"] == 62.5
    assert s["latency_median_s"] == 5.5 and s["latency_p90_s"] == 9.0


def _table(out: str, title: str, above: int = 2) -> list[list[str]]:
    """The rows (split on blanks) of the table whose title line starts with `title`, to its blank line; `above`:
    the lines above the rows (title, header)."""
    lines = out[out.index(title) :].split("\n\n")[0].splitlines()
    return [ln.split() for ln in lines[above:]]


@pytest.mark.slow
def test_quick_mode_prints_each_part_from_the_runs(tmp_path, capsys):
    vllm_python()  # fails with the reason without vLLM's environment (LICHEN_SKIP_VLLM=1 skips)
    out_json = tmp_path / "e.json"
    assert bench.main(["--quick", "--work-dir", str(tmp_path / "w"), "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    res = json.loads(out_json.read_text())
    assert res["vllm_missing"] is None and "NOT MEASURED" not in out

    # 1. every server's numbers are the JSON's, and those its passes' own tokens and wall times
    gen = _table(out, "1. generation")
    servers = res["gen"]["servers"]
    q = bench.QUICK
    for row in gen[:2]:
        r = servers[row[0]]
        assert r["requests"] == q["prompts"] * q["samples"] and r["forced_lengths"]
        assert r["tokens_each"] == [q["prompts"] * q["samples"] * q["tokens"]] * q["repeats"]
        assert r["tok_s"] == pytest.approx(r["tokens_each"][0] / r["wall_each_s"][0])
        assert r["tok_per_cpu_s"] == pytest.approx(r["tokens_each"][0] / r["cpu_each_s"][0])
        assert row[1:5] == [
            f"{r['tok_s']:.1f}",
            f"{r['latency_median_s']:.3f}",
            f"{r['latency_p90_s']:.3f}",
            f"{r['tok_per_cpu_s']:.1f}",
        ]
        assert r["pinned"]["threads_pinned"] > 0 and r["pinned"]["affinities"] == [res["settings"]["core_list"]]
    lc, vl = servers["lichen"], servers["vllm"]
    assert gen[2][:2] == ["lichen/vLLM", f"{lc['tok_s'] / vl['tok_s']:.2f}x"]

    # 2 and 3: the JSON's numbers are the runs' own metrics.jsonl, and the tables print them
    runs = res["train"][0]["runs"]
    for key, r in runs.items():
        rows = read_metrics(os.path.join(r["run_dir"], "out"))
        syncs = [x["time/sync"] for x in rows if x.get("time/sync") is not None]
        assert len(syncs) == q["steps"] and r["sync_each_s"] == syncs, key
        diffs = [x["train/train_rollout_logprob_abs_diff"] for x in rows]
        assert r["lp_diff_mean"] == pytest.approx(sum(diffs) / len(diffs)) and 0 < r["lp_diff_mean"] < 1e-3, key
    mismatch = _table(out, "2. rollout/trainer")
    for row in mismatch:
        if row[1] in ("lichen", "vllm"):
            r = runs[f"{row[1]}-{row[0]}"]
            assert row[2:] == [f"{r['lp_diff_mean']:.2e}", f"{r['lp_diff_max']:.2e}"]
    sync = _table(out, "3. time/sync", above=3)
    assert len(sync) == len(q["transports"])
    for row in sync:
        t = row[2]
        lc, vl = runs[f"lichen-{t}"], runs[f"vllm-{t}"]
        lcs, vls = lc["sync_s"], vl["sync_s"]
        lc2, vl2 = lc["sync_each_s"][1], vl["sync_each_s"][1]  # two steps: the one sync after the first
        assert row[3:] == [
            f"{lcs:.3f}",
            f"{vls:.3f}",
            f"{lcs / vls:.2f}x",
            f"{lc2:.3f}",
            f"{vl2:.3f}",
            f"{lc2 / vl2:.2f}x",
        ]
    assert re.search(r"load average around the measurements: [\d.]+ - [\d.]+", out)


@pytest.mark.slow
def test_without_vllm_the_bench_says_so_and_measures_lichen_alone(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LICHEN_VLLM_PYTHON", str(tmp_path / "no-python"))
    out_json = tmp_path / "e.json"
    argv = ["--quick", "--parts", "gen", "--work-dir", str(tmp_path / "w"), "--json", str(out_json)]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "vLLM's environment is missing" in out and "vLLM NOT MEASURED" in out and "no-python" in out
    res = json.loads(out_json.read_text())
    assert list(res["gen"]["servers"]) == ["lichen"] and "lichen/vLLM" not in out


def test_report_of_a_file_that_is_not_the_bench_json_is_one_error(tmp_path):
    from lichen.errors import ConfigError

    bad = tmp_path / "other.json"
    bad.write_text('{"a": 1}')
    for path in (bad, tmp_path / "missing.json"):
        with pytest.raises(ConfigError, match=f"--report {path}: not a JSON file written by lichen bench engines"):
            bench.main(["--report", str(path)])
