"""Every flag of slime's parser (and the Megatron flags of its scripts) at a pinned commit resolves to one class of
lichen's table with a reason; slime's own plug-in paths resolve through one alias table; slime's SFT script
converts and dry-runs in one invocation."""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest

import lichen.cli
from lichen.config import build_train_parser, parse_train_args, slime_compat
from lichen.config.parser import option_actions
from lichen.config.removed import removed_message
from lichen.config.slime.flags import CHECKED, CLASSES, MAPPED, SAME, SLIME_FLAGS, UNKNOWN
from lichen.config.slime.megatron_model import check_flag
from lichen.errors import ConfigError
from lichen.plugins import SLIME_ALIASES, load_function

FIXTURES = Path(__file__).parent / "fixtures"
FLAGS_FILE = FIXTURES / "slime_flags_624b824a.txt"
DOCS = Path(__file__).parent.parent / "docs" / "slime-compat.md"
KNOWN = {s for s in option_actions(build_train_parser()) if s.startswith("--")}


def fixture_flags() -> dict[str, list[str]]:
    """section -> flags of tests/fixtures/slime_flags_624b824a.txt."""
    sections: dict[str, list[str]] = {}
    current = ""
    for line in FLAGS_FILE.read_text().splitlines():
        if line.startswith("["):
            current = line.strip("[]")
            sections[current] = []
        elif line.startswith("--"):
            sections[current].append(line.strip())
    return sections


def test_fixture_pins_slime_commits_and_covers_its_parser_files():
    text = FLAGS_FILE.read_text()
    assert "624b824a898ab0ec1fcb4d373004c7f3852bf515" in text
    sections = fixture_flags()
    assert set(sections) == {
        "slime/utils/arguments.py",
        "slime/backends/sglang_utils/arguments.py",
        "slime/backends/megatron_utils/server/arguments.py",
        "scripts 624b824a",
        "scripts 2a60f00d",
    }
    assert len(sections["slime/utils/arguments.py"]) > 200  # the whole parser, not the flags of a few scripts


def test_every_flag_of_slimes_parser_resolves_to_one_class_with_a_reason():
    flags = sorted({f for fs in fixture_flags().values() for f in fs})
    counts: Counter = Counter()
    unresolved = []
    for flag in flags:
        rule = slime_compat.classify(flag, KNOWN)
        assert rule.cls in CLASSES, flag
        if rule.cls == UNKNOWN or not rule.reason:
            unresolved.append(flag)
        counts[rule.cls] += 1
    assert not unresolved, unresolved
    print("per class:", {cls: counts[cls] for cls in CLASSES if counts[cls]}, "of", len(flags))


def test_a_flag_has_one_row_only():
    """A table row for a flag lichen defines would never be used (lichen's flag wins): the table must drop it;
    a removed flag has no other row."""
    assert not set(SLIME_FLAGS) & KNOWN
    assert not [f for f in SLIME_FLAGS if removed_message(f) is not None]


GPT_OSS = {
    "model_type": "gpt_oss",
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096},
}


@pytest.mark.parametrize(
    "flag, values, found",
    [
        ("--window-size", ["128,0"], "matches /m/config.json sliding_window = 128"),
        ("--window-size", ["64,0"], "warning: --window-size 64 but /m/config.json sliding_window = 128"),
        ("--rope-scaling-factor", ["32"], "matches /m/config.json rope_scaling.factor = 32.0"),
        ("--use-rope-scaling", [], "matches /m/config.json rope_scaling (a scaled rope type) = True"),
        ("--activation-func-clamp-value", ["7.0"], "matches /m/config.json swiglu_limit = 7.0"),
        ("--softmax-type", ["learnable"], "config.json (model_type 'gpt_oss') defines it"),
        ("--quick-geglu", [], "config.json (model_type 'gpt_oss') defines it"),
    ],
)
def test_gpt_oss_architecture_flags_are_checked_against_config_json(flag, values, found):
    assert slime_compat.classify(flag, KNOWN).cls == CHECKED
    note, stops = check_flag(flag, values, GPT_OSS, "/m")
    assert found in note and not stops


def test_ci_test_maps_to_lichens_weight_equality_check_and_slimes_logprob_bound():
    out = slime_compat.scan(["--ci-test"], KNOWN)
    assert out.kept == ["--check-weight-update-equal", "--ci-train-rollout-logprob-abs-diff-threshold", "0.1"]
    assert out.rows[0].cls == MAPPED
    # the script's own bound wins, wherever it stands
    given = ["--ci-train-rollout-logprob-abs-diff-threshold", "1e-6", "--ci-test"]
    assert slime_compat.scan(given, KNOWN).kept == given[:2] + ["--check-weight-update-equal"]


# --- slime's plug-in paths ---------------------------------------------------------------------------------------

LOADED = {
    "slime.rollout.sglang_rollout.generate_rollout": "lichen.rollout.generate.generate_rollout",
    "slime.rollout.sft_rollout.generate_rollout": "lichen.rollout.sft.generate_rollout",
    "slime.rollout.forge_load.generate_rollout": "lichen.rollout.forge_load.generate_rollout",
    "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std": (
        "lichen.rollout.filters.check_reward_nonzero_std"
    ),
}


@pytest.mark.parametrize("path", sorted(LOADED))
def test_slime_path_loads_lichens_function(path):
    fn = load_function(path, "--rollout-function-path")
    assert f"{fn.__module__}.{fn.__name__}" == LOADED[path]


@pytest.fixture
def base(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hf = tmp_path / "hf"
    hf.mkdir()
    config = json.loads((FIXTURES / "slime" / "hf" / "Qwen3-4B" / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(config))
    for f in (FIXTURES / "slime" / "tokenizer").iterdir():
        shutil.copy(f, hf / f.name)
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    return [
        "--hf-checkpoint",
        "hf",
        "--prompt-data",
        "p.jsonl",
        "--num-rollout",
        "1",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
    ]


def test_slime_rm_hub_entry_point_is_lichens_rm_type_hub(base):
    args = parse_train_args(base + ["--rm-type", "math", "--custom-rm-path", "slime.rollout.rm_hub.async_rm"])
    assert (args.custom_rm_path, args.rm_type) == (None, "math")


def test_slime_batched_rm_hub_entry_point_scores_each_sample_with_the_hub(base):
    argv = ["--rm-type", "f1", "--custom-rm-path", "slime.rollout.rm_hub.batched_async_rm", "--group-rm"]
    args = parse_train_args(base + argv)
    assert (args.custom_rm_path, args.group_rm, args.rm_type) == (None, False, "f1")


def test_slime_generate_is_lichens_default_generation(base):
    argv = ["--rm-type", "math", "--custom-generate-function-path", "slime.rollout.sglang_rollout.generate"]
    assert parse_train_args(base + argv).custom_generate_function_path is None


def test_slime_rollout_path_is_resolved_in_the_config(base):
    argv = ["--rm-type", "math", "--rollout-function-path", "slime.rollout.sglang_rollout.generate_rollout"]
    assert parse_train_args(base + argv).rollout_function_path == "lichen.rollout.generate.generate_rollout"


def test_every_alias_is_tested_and_documented():
    tested = set(LOADED) | {
        "slime.rollout.rm_hub.async_rm",
        "slime.rollout.rm_hub.batched_async_rm",
        "slime.rollout.sglang_rollout.generate",
    }
    assert tested == set(SLIME_ALIASES)
    docs = DOCS.read_text()
    for path, alias in SLIME_ALIASES.items():
        assert f"`{path}`" in docs and (alias.target is None or f"`{alias.target}`" in docs), path


def test_other_slime_paths_get_one_clear_error():
    with pytest.raises(ConfigError, match="lichen has no equivalent of this slime function"):
        load_function("slime.rollout.sleep_rollout.sleep", "--rollout-function-path")
    with pytest.raises(ConfigError, match="no plug-in path is needed"):
        load_function("slime.rollout.rm_hub.async_rm", "--custom-rm-path")


# --- SFT -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sft", [["--loss-type", "sft_loss"], ["--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout"]]
)
def test_sft_needs_no_rm_type(base, sft):
    args = parse_train_args(base + sft)
    assert args.rm_type is None and args.custom_rm_path is None


def test_rl_still_needs_a_reward(base):
    with pytest.raises(ConfigError, match="a reward is required"):
        parse_train_args(base)


def test_debug_train_only_without_dumps_is_labelled_differs():
    out = slime_compat.scan(["--debug-train-only"], KNOWN)
    assert out.rows[0].cls == "differs" and "--load-debug-rollout-data" in out.rows[0].note
    out = slime_compat.scan(["--debug-train-only", "--load-debug-rollout-data", "d/{rollout_id}"], KNOWN)
    assert out.rows[0].cls == SAME


def test_slime_sft_script_converts_and_dry_runs_in_one_invocation(tmp_path, monkeypatch, capsys):
    """slime's scripts/run-qwen3-4B-base-sft.sh: one invocation, every stop in its output. What still stops it
    (with the port-slime of this commit): the Megatron torch_dist --ref-load (--lr-warmup-fraction with a run length
    given as --num-epoch resolves once the data is read: lichen's own flag)."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    shutil.copytree(FIXTURES / "slime" / "hf" / "Qwen3-4B-Base", tmp_path / "Qwen3-4B-Base")
    for f in (FIXTURES / "slime" / "tokenizer").iterdir():
        shutil.copy(f, tmp_path / "Qwen3-4B-Base" / f.name)
    (tmp_path / "Qwen3-4B-Base_torch_dist" / "iter_0000001").mkdir(parents=True)
    (tmp_path / "Qwen3-4B-Base_torch_dist" / "iter_0000001" / ".metadata").write_bytes(b"")
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    pq.write_table(pa.table({"messages": [conversation]}), tmp_path / "openhermes2_5.parquet")
    monkeypatch.setenv("BASE_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    script = FIXTURES / "slime" / "scripts" / "run-qwen3-4B-base-sft.sh"
    # NVLINK_COUNT comes from `nvidia-smi topo -m`, which port-slime cannot run: settled like every slime script
    rc = lichen.cli.main(["port-slime", str(script), "-o", "sft.yaml", "--assume", "NVLINK_COUNT=0"])
    out, err = capsys.readouterr()
    table = out[out.index("slime/Megatron flags") :]
    assert "mapped | --rollout-function-path slime.rollout.sft_rollout.generate_rollout" in table
    assert "mapped | --debug-train-only | left out" in table
    assert "mapped | train_async.py | lichen train (synchronous)" in table
    assert "mapped | --disable-compute-advantages-and-returns" in table
    assert "rm-type" not in err and "a reward is required" not in err
    # what stops it is in this one invocation's output
    assert rc == 2
    assert "torch_dist" in err and "--lr-warmup-fraction" not in err
    assert not re.search(r"^  unknown \|", table, re.M)
    print("sft:", re.search(r"^counts: (.*)$", table, re.M).group(1))
