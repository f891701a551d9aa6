"""`lichen bench sync`: --help, and a smoke run on a tiny model (one AdamW step, every transport, a real
`lichen serve` engine) whose table must list every transport and show the xor delta smaller than the full sync."""

from __future__ import annotations

import json
import os
import re

import pytest

from lichen_bench import sync as bench_sync

pytestmark = pytest.mark.e2e  # see the marker in pyproject.toml: make test leaves it to make test-e2e


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as info:
        bench_sync.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--params", "--steps", "--lr", "--bandwidth", "--transports", "--json"):
        assert flag in out


def test_bad_values_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as info:
        bench_sync.main(["--steps", "0"])
    assert info.value.code == 2 and "--steps must be at least 1" in capsys.readouterr().err


def test_model_shape_reaches_the_requested_size():
    for params in (1e6, 2e7, 5e8):
        s = bench_sync.model_shape(params)
        h, m = s["hidden_size"], s["intermediate_size"]
        got = s["num_layers"] * (4 * h * h + 3 * h * m)
        assert 0.8 * params < got < 1.25 * params


@pytest.mark.slow
def test_smoke_run_prints_every_transport(tmp_path, capsys):
    out_json = tmp_path / "r.json"
    assert (
        bench_sync.main(
            [
                "--params",
                "1e6",
                "--steps",
                "1",
                "--threads",
                "1",
                "--work-dir",
                str(tmp_path / "w"),
                "--json",
                str(out_json),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    table = out[out.index("transport ") :]
    for name in ("full", "xor", "overwrite", "nccl"):
        assert re.search(rf"^{name}\s", table, re.M), name
    assert len(re.findall(r"\[(PASS|MISS)\]", table)) == 5
    summary = {r["transport"]: r for r in json.loads(out_json.read_text())["summary"]}
    assert summary["xor"]["wire_bytes"] < summary["full"]["wire_bytes"]
    assert summary["overwrite"]["wire_bytes"] < summary["full"]["wire_bytes"]
    assert 0 < summary["xor"]["changed_density"] < 0.5  # one small AdamW step moves a few percent of the bytes
    for r in summary.values():  # one end-to-end time per timed sync; their mean is the table's
        assert len(r["e2e_each_s"]) == 1 and abs(sum(r["e2e_each_s"]) - r["e2e_s"]) < 1e-9
    assert re.search(r"^  xor\s+\d+\.\d{3}$", out[out.index("each timed sync") :], re.M)


def test_ray_numbers_come_from_the_metrics_rows():
    """run_numbers reads what each run logged: delta times only its delta versions, the driver's peak is the max of
    its own `memory/<phase>_peak_rss_gb` (not a rank's or an engine's), each rank's from its own keys."""
    from lichen_bench import sync_ray

    rows = [
        {"step": 1, "time/sync": 3.0, "time/sync_publish": 2.0, "sync/is_delta": False, "memory/sync_peak_rss_gb": 1.5,
         "memory/rank0/sync_peak_rss_gb": 2.5, "memory/rank1/sync_peak_rss_gb": 2.0, "memory/rank0/load_peak_rss_gb": 1.1,
         "memory/rank1/load_peak_rss_gb": 1.2, "memory/engine0/sync_peak_rss_gb": 9.0},
        {"step": 2, "time/sync": 1.0, "time/sync_publish": 0.5, "sync/is_delta": True, "memory/train_peak_rss_gb": 1.7,
         "memory/rank0/sync_peak_rss_gb": 2.6, "memory/rank1/sync_peak_rss_gb": 1.9},
        {"step": 3, "time/sync": 2.0, "time/sync_publish": 1.5, "sync/is_delta": True},
    ]  # fmt: skip
    delta = sync_ray.run_numbers(rows, "delta", 2)
    assert delta["sync_each_s"] == [1.0, 2.0] and delta["sync_s"] == 1.5 and delta["publish_s"] == 1.0
    assert delta["driver_peak_gb"] == 1.7
    assert delta["rank_sync_peak_gb"] == [2.6, 2.0] and delta["rank_load_peak_gb"] == [1.1, 1.2]
    full = sync_ray.run_numbers(rows, "disk", 2)
    assert full["sync_each_s"] == [3.0, 1.0, 2.0] and full["sync_s"] == 2.0


def test_ray_bad_values_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as info:
        bench_sync.main(["--runtime", "ray", "--transports", "xor"])
    assert info.value.code == 2 and "invalid choice: 'xor'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        bench_sync.main(["--runtime", "ray", "--steps", "0"])
    assert info.value.code == 2 and "--steps must be at least 1" in capsys.readouterr().err


def _printed_row(out: str, pattern: str) -> list[str]:
    found = re.findall(pattern, out, re.M)
    assert len(found) >= 1, (pattern, out)
    return found


@pytest.mark.slow
def test_ray_runtime_smallest_size_one_transport_prints_measured_numbers(tmp_path, capsys):
    """`lichen bench sync --runtime ray` on a tiny model, nccl only: every layout ran in its own run directory,
    and every number of the tables is the one those runs' metrics.jsonl hold (read here independently)."""
    from lichen.observe.metrics import read_metrics
    from lichen_bench import sync_ray

    out_json = tmp_path / "r.json"
    argv = ["--runtime", "ray", "--sizes", "1e5", "--transports", "nccl", "--steps", "1", "--baseline-params", "1e4"]
    assert bench_sync.main([*argv, "--work-dir", str(tmp_path / "w"), "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    res = json.loads(out_json.read_text())
    (entry,) = res["sizes"]
    assert sorted(entry["runs"]) == ["local1-nccl", "ray2-nccl"] and sorted(res["baseline"]) == ["nccl"]
    dirs = {r["run_dir"] for r in [*entry["runs"].values(), *res["baseline"].values()]}
    assert len(dirs) == 3  # a fresh directory per run

    def logged(run: dict) -> list[dict]:
        return read_metrics(os.path.join(run["run_dir"], "out"))

    ray, local, base = entry["runs"]["ray2-nccl"], entry["runs"]["local1-nccl"], res["baseline"]["nccl"]
    for run in (ray, local, base):
        assert run["sync_each_s"] == [r["time/sync"] for r in logged(run)] and len(run["sync_each_s"]) == 1
    # time/sync: ray, local, ratio
    m = f"{entry['params'] / 1e6:.1f}M"
    (row,) = _printed_row(out, rf"^\s*{re.escape(m)} nccl\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x$")
    assert float(row[0]) == pytest.approx(ray["sync_s"], abs=6e-4)
    assert float(row[1]) == pytest.approx(local["sync_s"], abs=6e-4)
    assert float(row[2]) == pytest.approx(ray["sync_s"] / local["sync_s"], abs=6e-3)
    # the driver's peak: its own phases' keys in the Ray run
    driver = max(v for r in logged(ray) for k, v in r.items() if re.fullmatch(r"memory/[a-z_]+_peak_rss_gb", k))
    assert ray["driver_peak_gb"] == driver
    assert _printed_row(out, rf"^\s*{re.escape(m)} ([\d.]+)$") == [f"{driver:.3f}"]
    # each rank: its sync and load peaks, and the bounds from the baseline run's own peaks
    bound = sync_ray.bounds(entry, 128 * 1024**2)
    rows = _printed_row(
        out, rf"^\s*{re.escape(m)} nccl\s+(\d) +([\d.]+) +([\d.]+) (ok|OVER) +([\d.]+) +([\d.]+) (ok|OVER)$"
    )
    assert [r[0] for r in rows] == ["0", "1"]
    for rank, sync_gb, sync_bound, _, load_gb, load_bound, _ in rows:
        r = int(rank)
        sync_peak = max(row[f"memory/rank{r}/sync_peak_rss_gb"] for row in logged(ray))
        load_peak = max(
            row[f"memory/rank{r}/load_peak_rss_gb"] for row in logged(ray) if f"memory/rank{r}/load_peak_rss_gb" in row
        )
        base_sync = max(row[f"memory/rank{r}/sync_peak_rss_gb"] for row in logged(base))
        base_load = max(
            row[f"memory/rank{r}/load_peak_rss_gb"] for row in logged(base) if f"memory/rank{r}/load_peak_rss_gb" in row
        )
        assert float(sync_gb) == pytest.approx(sync_peak, abs=6e-3) and float(load_gb) == pytest.approx(
            load_peak, abs=6e-3
        )
        assert float(sync_bound) == pytest.approx(base_sync + bound["sync_gb"], abs=6e-3)
        assert float(load_bound) == pytest.approx(base_load + bound["load_gb"], abs=6e-3)
    assert re.search(r"^1-minute load average around the runs: [\d.]+ - [\d.]+ \(2 cores\)$", out, re.M)
