"""`python -m lichen_bench.decode_profile` (benchmarks/lichen_bench/decode_profile.py): the decode forwards it
records are the engine's (one prefill per distinct prompt, then one forward per token after the first, over one
more key slot each time), the key/value bytes it counts are the bytes attention was handed, and the three parts
cover the profiled pass."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from lichen_bench import decode_profile


def test_counts_the_engines_forwards_and_the_bytes_attention_reads(tmp_path, monkeypatch, capsys):
    handed = {"bytes": 0}
    sdpa = F.scaled_dot_product_attention

    def counting(q, k, v, *args, **kwargs):
        # a decode forward's query (one new token per row) in the profiled pass
        if q.shape[2] == 1 and torch.autograd._profiler_enabled():
            handed["bytes"] += k.numel() * k.element_size() + v.numel() * v.element_size()
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    out = tmp_path / "profile.json"
    argv = ["--model", "1e5", "--prompts", "2", "--samples", "3", "--tokens", "4", "--matmul-size", "128"]
    assert decode_profile.main([*argv, "--work-dir", str(tmp_path / "w"), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    (rows, longest), *more = res["prefills"]
    assert rows == 2 and not more  # the 3 samples of each prompt share its prefill row
    # 4 forced tokens: the first from the prefill's logits, then one decode forward per token, every row live
    assert res["decode_forwards"] == [[6, longest + 1], [6, longest + 2], [6, longest + 3]]
    assert res["kv_bytes"] == handed["bytes"] > 0
    parts = res["parts"]
    assert parts["matmul"]["flops"] > 0 and parts["attention"]["s"] > 0
    assert set(res["attention_kernels_s"]) == {"sdpa", "explicit"}
    lines = capsys.readouterr().out.splitlines()
    assert any("3 decode forwards (mean 6.0 rows" in line for line in lines)
    table = [
        line.split() for line in lines if line.split()[:1] in (["matmul"], ["attention"], ["other"]) and "%" in line
    ]
    assert [r[0] for r in table] == ["matmul", "attention", "other"]
    # other = the unprofiled pass minus the two profiled parts (at least 0: on a model this small the profiler
    # stretches the two parts past an unprofiled pass)
    assert sum(float(r[2].rstrip("%")) for r in table) >= 99.8 and float(table[2][2].rstrip("%")) >= 0
    assert sum("attention of one decode step at the mean shape (6 rows" in line for line in lines) == 2


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_the_explicit_attention_is_the_engines(kv_heads):
    """The comparison's second kernel computes what the engine's scaled_dot_product_attention does (grouped
    query heads included), against a float64 reference."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 1, 16, generator=g, dtype=torch.float64)
    k = torch.randn(3, kv_heads, 7, 16, generator=g, dtype=torch.float64)
    v = torch.randn(3, kv_heads, 7, 16, generator=g, dtype=torch.float64)
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=kv_heads != 4)
    torch.testing.assert_close(decode_profile.explicit_attention(q, k, v), want, rtol=1e-12, atol=1e-12)


def test_refuses_zero_tokens():
    with pytest.raises(SystemExit) as e:
        decode_profile.main(["--tokens", "0"])
    assert e.value.code == 2
