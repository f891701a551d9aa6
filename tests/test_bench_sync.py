"""`lichen bench sync`: --help, and a smoke run on a tiny model (one AdamW step, every transport, a real
`lichen serve` engine) whose table must list every transport and show the xor delta smaller than the full sync."""

from __future__ import annotations

import json
import re

import pytest

from lichen_bench import sync as bench_sync


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
