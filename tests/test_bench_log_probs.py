"""`lichen bench logprobs` (benchmarks/lichen_bench/log_probs.py) at toy size: both variants run in their own
child processes and the report has their medians, the two ratios and a JSON record. A harness check, not a
timing: the numbers themselves are docs/performance.md's."""

from __future__ import annotations

import json

import pytest

from lichen_bench import log_probs as bench


@pytest.mark.slow
def test_toy_run_reports_both_variants_and_the_ratios(tmp_path, capsys):
    out = tmp_path / "report.json"
    argv = ["--vocab", "300", "--hidden", "64", "--tokens", "32", "--samples", "2", "--chunk-size", "16"]
    argv += ["--repeats", "2", "--threads", "1", "--work-dir", str(tmp_path), "--json", str(out)]
    assert bench.main(argv) == 0
    text = capsys.readouterr().out
    assert "full (chunk -1)" in text and "chunked (chunk 16)" in text and "ratio chunked / full" in text
    report = json.loads(out.read_text())
    assert [c["chunk_size"] for c in report["runs"]["full"]] == [-1]
    assert [c["chunk_size"] for c in report["runs"]["chunked"]] == [16]
    for name in ("full", "chunked"):
        steps = report["runs"][name][0]["steps"]
        assert len(steps) == 2 and all(s["seconds"] > 0 and s["peak_bytes"] >= 0 for s in steps)
    assert set(report["ratios"]) == {"seconds", "peak_bytes"}
