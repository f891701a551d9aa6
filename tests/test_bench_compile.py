"""`lichen bench compile` (benchmarks/lichen_bench/compile_layers.py) at toy size: the layers really are compiled,
the report has both variants, the ratio, the compile time apart, and the agreement of log-probs and gradients. A
harness check, not a timing: the numbers themselves are docs/performance.md's."""

from __future__ import annotations

import json

import pytest
import torch

from lichen_bench import compile_layers as bench

TOY = ["--hidden", "32", "--layers", "2", "--heads", "2", "--mlp", "64", "--vocab", "100", "--batch", "2"]
TOY += ["--seq", "8", "--repeats", "2", "--threads", "1"]


@pytest.mark.slow
def test_toy_run_reports_both_variants_the_compile_time_and_the_agreement(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert bench.main([*TOY, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "eager" in text and "compiled / eager step time" in text and "first compiled step" in text
    report = json.loads(out.read_text())
    assert len(report["times"]["eager"]) == len(report["times"]["compiled"]) == 2
    assert report["first_compiled_step_s"] > 0 and report["eager_s"] > 0
    assert report["max_logprob_diff"] < 1e-5 and report["max_grad_diff_rel"] < 1e-5  # fp32: the same math


def test_each_decoder_layer_is_compiled_and_computes_what_the_eager_layer_does():
    args = bench.parse_args(TOY)
    eager = bench.build(args)
    compiled = bench.build(args)
    bench.compile_layers(compiled)
    assert all(isinstance(layer, torch._dynamo.eval_frame.OptimizedModule) for layer in compiled.model.layers)
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(9)[None].expand(2, -1)
    _, want, _ = bench.step(eager, ids, pos)
    _, got, _ = bench.step(compiled, ids, pos)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("argv", [["--batch", "0"], ["--hidden", "30", "--heads", "4"]])
def test_bad_values_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2 and "--" in capsys.readouterr().err
