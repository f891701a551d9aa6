"""Validation of the train/inference mismatch correction flags (--use-tis and friends)."""

import pytest

from lichen.config import parse_train_args
from lichen.errors import ConfigError


@pytest.fixture
def base(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    return [
        "--hf-checkpoint",
        str(tmp_path / "m"),
        "--prompt-data",
        str(tmp_path / "p.jsonl"),
        "--rm-type",
        "exact",
        "--rollout-batch-size",
        "1",
        "--n-samples-per-prompt",
        "2",
        "--num-rollout",
        "1",
    ]


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--use-tis", "--use-rollout-logprobs"], "--use-rollout-logprobs"),
        (["--tis-mode", "icepop"], "--use-tis"),
        (["--custom-tis-function-path", "os.path.join"], "--use-tis"),
        (["--use-tis", "--tis-clip", "0.9"], "--tis-clip"),
        (["--use-tis", "--tis-clip-low", "1.5"], "--tis-clip-low"),
    ],
)
def test_bad_tis_combinations(base, extra, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_train_args(base + extra)


def test_good_tis(base):
    args = parse_train_args(base + ["--use-tis", "--tis-mode", "icepop", "--tis-clip", "3", "--tis-clip-low", "0.2"])
    assert args.use_tis and args.tis_mode == "icepop"
