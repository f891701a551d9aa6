"""scripts/slime_scripts_table.py (docs/slime-compat.md's per-script table) on tests/fixtures/slime: one row per
launch script with its exit codes without / with --ref-load-is-hf-checkpoint, class counts and stops; and the
scratch $BASE_DIR it builds (lichen.port_slime.trial_base)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from lichen.port_slime.bash_values import Assumptions
from lichen.port_slime.trial_base import config_from_model_args, mismatches, populate, read_inputs

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "slime"
HF_REF_STOP = "--runtime ray: give --rollout-num-gpus R (devices for the engines) or --rollout-num-engines K"
# script -> (model_type, rc, rc with --ref-load-is-hf-checkpoint, stops, stops with it)
EXPECTED = {
    "run-glm4-9B.sh": ("glm4", "2", "0", "torch_dist `--ref-load`", "-"),
    "run-glm4.7-30B-A3B.sh": (
        "glm4_moe_lite",
        "2",
        "2",
        "`--enable-mtp-training`, `--mtp-loss-scaling-factor`, torch_dist `--ref-load`",
        "`--enable-mtp-training`, `--mtp-loss-scaling-factor`, --update-weight-mode delta needs "
        "--update-weight-local-checkpoint-dir DIR",
    ),
    "run-gpt-oss-20B.sh": (
        "gpt_oss",
        "2",
        "2",
        "`--megatron-to-hf-mode`, torch_dist `--ref-load`",
        "`--megatron-to-hf-mode`",
    ),
    "run-qwen3-4B-base-sft.sh": ("qwen3", "2", "2", "torch_dist `--ref-load`", HF_REF_STOP),
    "run-qwen3-4B-debug-rollout-only.sh": ("qwen3", "0", "0", "-", "same"),
    "run-qwen3-4B-debug-train-only.sh": ("qwen3", "0", "0", "-", "same"),
    "run-qwen3-4B.sh": ("qwen3", "2", "0", "torch_dist `--ref-load`", "-"),
}


def _load_script():
    spec = importlib.util.spec_from_file_location("slime_scripts_table", ROOT / "scripts" / "slime_scripts_table.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def table_script(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret-0123456789")  # run-glm4-9B.sh passes it to --wandb-key
    return _load_script()


def test_table_has_one_row_per_fixture_script(table_script, tmp_path, capsys):
    assert table_script.main([str(FIXTURES), "--work", str(tmp_path / "work")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[:4] == ["script", "model_type", "rc", "rc `--ref-load-is-hf-checkpoint`"]
    rows = {}
    for line in lines[2:]:
        cells = dict(zip(header, (c.strip() for c in line.strip().strip("|").split(" | "))))
        rows[cells["script"].strip("`")] = cells
    assert set(rows) == set(EXPECTED)
    for script, (model_type, rc, rc_hf, stops, stops_hf) in EXPECTED.items():
        row = rows[script]
        got = (row["model_type"], row["rc"], row[header[3]], row["stops"], row[header[-1]])
        assert got == (model_type, rc, rc_hf, stops, stops_hf), script
        assert row["unknown"] == "0" and int(row["checked"]) >= 15 and int(row["same"]) >= 26, row
    # the scratch tree stays where --work said, with slime's paths inside it and nothing of the secret
    work = tmp_path / "work"
    assert (work / "run-qwen3-4B" / "Qwen3-4B" / "config.json").is_file()
    for path in work.rglob("*.yaml"):
        assert "wandb-secret-0123456789" not in path.read_text()


def test_only_selects_scripts_and_a_missing_source_is_one_line(table_script, tmp_path, capsys):
    assert table_script.main([str(FIXTURES), "--work", str(tmp_path / "w"), "--only", "run-qwen3-4B.sh"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 3
    with pytest.raises(SystemExit, match="neither a directory with scripts/ nor a git repository"):
        table_script.main([str(tmp_path / "nothing-here"), "--work", str(tmp_path / "w2")])


def test_config_from_model_args_has_the_released_models_dimensions(tmp_path):
    """MODEL_ARGS of the fixture's qwen3-4B.sh, through the checked table, give Qwen3-4B's config.json numbers; and
    every checked comparison of the built config matches."""
    script = tmp_path / "models" / "qwen3-4B.sh"
    script.parent.mkdir()
    script.write_text((FIXTURES / "scripts" / "models" / "qwen3-4B.sh").read_text())
    run = tmp_path / "run.sh"
    run.write_text('source "$(dirname "${BASH_SOURCE[0]}")/models/qwen3-4B.sh"\npython3 train.py ${MODEL_ARGS[@]}\n')
    inputs = read_inputs(str(run), Assumptions(), environ={})
    assert inputs.model_type == "qwen3" and inputs.model_args
    config = config_from_model_args(inputs.model_args, inputs.model_type)
    released = json.loads((FIXTURES / "hf" / "Qwen3-4B" / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
        assert config[key] == released[key], key
    assert config["head_dim"] == released["head_dim"] and config["vocab_size"] == released["vocab_size"]
    assert config["tie_word_embeddings"] is released["tie_word_embeddings"]
    assert mismatches(inputs.model_args, config) == []
    assert mismatches(inputs.model_args, {**config, "hidden_size": 1}) != []


def test_populate_writes_what_the_dry_run_reads(tmp_path):
    """config.json + tokenizer, a torch_dist --ref-load, no --load that is the --save dir, one-prompt data under
    the script's --input-key, and the file a `cat > FILE <<EOF` of the script writes (bash would)."""
    base = tmp_path / "b"
    run = tmp_path / "run.sh"
    run.write_text(
        f'B={base}\nCFG=$B/sglang.yaml\ncat > "$CFG" <<EOF\nsglang:\n  - name: $((1 + 1))\nEOF\n'
        "MODEL_ARGS=(--num-layers 2 --hidden-size 8 --untie-embeddings-and-output-weights --window-size 128,0)\n"
        "python3 train.py ${MODEL_ARGS[@]} --hf-checkpoint $B/M --ref-load $B/M_torch_dist --load $B/M_slime "
        "--save $B/M_slime --prompt-data $B/d/p.jsonl --input-key question --sglang-config $CFG\n"
    )
    inputs = read_inputs(str(run), Assumptions(), environ={})
    config = populate(inputs, str(base), str(FIXTURES / "tokenizer"))
    assert config == json.loads((base / "M" / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["tie_word_embeddings"] is False
    assert config["sliding_window"] == 128
    assert (base / "M" / "tokenizer.json").is_file()
    assert (base / "M_torch_dist" / "iter_0000001" / ".metadata").is_file()
    assert not (base / "M_slime").exists()
    assert json.loads((base / "d" / "p.jsonl").read_text()) == {"question": "1+1?", "label": "2"}
    assert (base / "sglang.yaml").read_text() == "sglang:\n  - name: 2\n"
