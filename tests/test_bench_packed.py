"""`lichen bench packed` (benchmarks/lichen_bench/packed_attn.py) at toy size: both variants run on the same packed
micro-batches, the report has their times, the ratio and their agreement. A harness check, not a timing: the
numbers themselves are docs/performance.md's."""

from __future__ import annotations

import json

import pytest

from lichen_bench import packed_attn as bench

TOY = ["--hidden", "32", "--layers", "2", "--heads", "2", "--mlp", "64", "--vocab", "100", "--prompts", "2"]
TOY += ["--samples", "3", "--answer-mean", "10", "--max-tokens", "40", "--repeats", "2"]


def test_toy_run_reports_both_variants_and_their_agreement(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert bench.main([*TOY, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "dense mask (one call)" in text and "per segment / dense step time" in text
    report = json.loads(out.read_text())
    assert len(report["times"]["dense"]) == len(report["times"]["segments"]) == 2
    assert report["micro_batches"] >= 2 and report["dense_s"] > 0 and report["segments_s"] > 0
    assert report["max_hidden_diff"] < 1e-5 and report["max_grad_diff_rel"] < 1e-5  # fp32: the same math


def test_the_micro_batches_are_packed_with_shared_prompts():
    args = bench.parse_args(TOY)
    mbs = bench.micro_batches(args, bench.torch.device("cpu"))
    layouts = [mb.attn_mask for mb in mbs if mb.attn_mask is not None]  # None: one sample per row, plain causal
    assert layouts
    assert any(u.parts for layout in layouts for row in layout.rows for u in row)  # a prompt shared by its answers
    assert sum(len(mb.indices) for mb in mbs) == 6
    lone = bench.micro_batches(bench.parse_args([*TOY, "--no-sharing"]), bench.torch.device("cpu"))
    assert not any(u.parts for mb in lone if mb.attn_mask for row in mb.attn_mask.rows for u in row)


@pytest.mark.parametrize("argv", [["--prompts", "0"], ["--hidden", "30", "--heads", "4"], ["--answer-mean", "0"]])
def test_bad_values_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2 and "--" in capsys.readouterr().err
