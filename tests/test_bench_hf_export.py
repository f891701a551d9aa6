"""`python -m lichen_bench.hf_export` (benchmarks/lichen_bench/hf_export.py): two gloo ranks export a small model
both ways and the report prints each variant's row and the ratios; the split variant gives each rank a share of
the bytes, the rank-0 baseline all of them to rank 0."""

from __future__ import annotations

import pytest

from lichen_bench import hf_export


@pytest.mark.slow
def test_prints_both_variants_and_the_ratios(capsys, tmp_path):
    assert hf_export.main(["--params", "3e6", "--file-mb", "1", "--rounds", "1", "--work-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("model: ")
    rows = {line.split()[0]: line.split() for line in out if line.startswith(("split ", "rank0 "))}
    split, rank0 = rows["split"], rows["rank0"]
    # bytes per rank: "a / b"
    s0, s1, r0, r1 = float(split[1]), float(split[3]), float(rank0[1]), float(rank0[3])
    assert s0 > 0 and s1 > 0 and r1 == 0 and abs((s0 + s1) - r0) < 0.011
    assert out[-1].startswith("ratios, split / rank0: sync export ")
    assert list(tmp_path.iterdir()) == []  # the work directory is removed


def test_refuses_one_rank():
    with pytest.raises(SystemExit) as e:
        hf_export.main(["--ranks", "1"])
    assert e.value.code == 2
