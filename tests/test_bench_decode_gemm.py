"""`python -m lichen_bench.decode_gemm` (benchmarks/lichen_bench/decode_gemm.py) runs and prints one row per live-row
count with the four variants, and refuses a count below 1."""

from __future__ import annotations

import pytest

from lichen_bench import decode_gemm


def test_prints_a_row_per_count(capsys):
    assert decode_gemm.main(["--rows", "1", "3", "--repeats", "1", "--layers", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("one thread: memory read") and "MB per step" in out[0]
    rows = [line.split() for line in out[2:]]
    assert [r[0] for r in rows] == ["1", "3"]
    assert all(line.count(" ms ") == 4 and line.count("GB/s") == 4 for line in out[2:])


def test_refuses_zero_rows():
    with pytest.raises(SystemExit) as e:
        decode_gemm.main(["--rows", "0"])
    assert e.value.code == 2
