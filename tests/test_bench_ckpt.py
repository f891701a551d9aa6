"""`lichen bench ckpt` (benchmarks/lichen_bench/ckpt_save.py): the flags each variant gives `lichen train` parse to
the save mode it names, and the report's medians and ratios come from the runs' own step times. A harness check:
the numbers are docs/fault-tolerance.md's."""

from __future__ import annotations

import pytest

from lichen.config import parse_train_args
from lichen.errors import ConfigError
from lichen_bench import ckpt_save as bench


@pytest.mark.parametrize(
    "variant, save, asynchronous", [("none", None, True), ("sync", "ck", False), ("async", "ck", True)]
)
def test_each_variant_is_the_save_mode_it_names(tiny_ckpt, addition_data, tmp_path, variant, save, asynchronous):
    flags = ["--hf-checkpoint", tiny_ckpt, "--prompt-data", addition_data, "--output-dir", str(tmp_path / "o")]
    flags += ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rm-type", "math", "--num-rollout", "2"]
    args = parse_train_args(flags + bench.variant_flags(variant, "ck"))
    assert args.save == save and args.async_save is asynchronous
    assert args.save_interval == (1 if save else None)


def test_summary_medians_and_ratios():
    runs = [
        {"variant": "none", "step_s": [10.0, 12.0, 11.0], "save_s": [0.0, 0.0, 0.0]},
        {"variant": "sync", "step_s": [15.0, 14.0, 16.0], "save_s": [4.0, 3.0, 5.0]},
        {"variant": "async", "step_s": [11.0, 11.5, 12.5], "save_s": [0.5, 0.4, 0.6]},
        {"variant": "async", "error": "rc 1"},
    ]
    s = bench.summarize(runs, ["none", "sync", "async"])
    assert s["none"]["step_s"] == 11.0 and s["sync"]["step_s"] == 15.0 and s["async"]["step_s"] == 11.5
    assert s["sync"]["save_s"] == 4.0 and s["async"]["save_s"] == 0.5
    assert s["sync"]["ratio_to_none"] == pytest.approx(15 / 11) and s["async_over_sync"] == pytest.approx(11.5 / 15)


def test_unknown_variant_is_one_clear_error():
    with pytest.raises(ConfigError, match="--variants 'none,fast': choose from none, sync, async"):
        bench.main(["--variants", "none,fast"])
