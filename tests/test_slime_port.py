"""`lichen port-slime`: the six slime launch scripts of tests/fixtures/slime convert and dry-run in ONE invocation
each, with the complete class table; and the bash reader behind it."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

import lichen.cli
from lichen.errors import ConfigError
from lichen.port_slime.bash_values import Assumptions
from lichen.port_slime.script import read_script
from lichen.port_slime.trial_base import copy_tokenizer, write_data_file, write_torch_dist

FIXTURES = Path(__file__).parent / "fixtures" / "slime"
MODELS = ("Qwen3-4B", "GLM-Z1-9B-0414", "gpt-oss-20b-bf16", "GLM-4.7-Flash")
TORCH_DIST = ("Qwen3-4B_torch_dist", "GLM-Z1-9B-0414_torch_dist", "gpt-oss-20b_torch_dist", "GLM-4.7-Flash_torch_dist")
# script -> (exit code, what stops it when 2 and rows the table must hold)
SCRIPTS = {
    "run-qwen3-4B": (2, ["--ref-load", "torch_dist"]),
    # glm4, gpt_oss and glm4_moe_lite run on the generic HF path (a mapped row); the Megatron --ref-load stops them
    "run-glm4-9B": (2, ["torch_dist", "mapped | model_type glm4 | --model-impl hf"]),
    "run-gpt-oss-20B": (
        2,
        ["--megatron-to-hf-mode was removed", "torch_dist", "mapped | model_type gpt_oss | --model-impl hf"],
    ),
    "run-glm4.7-30B-A3B": (
        2,
        ["--enable-mtp-training", "mapped | model_type glm4_moe_lite | --model-impl hf"],
    ),
    "run-qwen3-4B-debug-rollout-only": (0, []),
    "run-qwen3-4B-debug-train-only": (0, []),
}


@pytest.fixture
def base_dir(tmp_path, monkeypatch):
    """$BASE_DIR of the fixture scripts: config.json + tiny tokenizer per model, torch_dist dirs, data files."""
    for name in MODELS:
        shutil.copytree(FIXTURES / "hf" / name, tmp_path / name)
        copy_tokenizer(str(FIXTURES / "tokenizer"), str(tmp_path / name))
    for name in TORCH_DIST:
        write_torch_dist(str(tmp_path / name))
    for rel in ("dapo-math-17k/dapo-math-17k.jsonl", "aime-2024/aime-2024.jsonl", "rl_data/aime-2024.jsonl"):
        write_data_file(str(tmp_path / rel))
    monkeypatch.setenv("BASE_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret-0123456789")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_each_slime_script_converts_and_dry_runs_in_one_invocation(base_dir, capsys, script):
    path = FIXTURES / "scripts" / f"{script}.sh"
    rc = lichen.cli.main(["port-slime", str(path), "-o", f"{script}.yaml", "--assume", "NVLINK_COUNT=0"])
    out, err = capsys.readouterr()
    expected_rc, stops = SCRIPTS[script]
    assert rc == expected_rc, err
    for needle in stops:
        assert needle in out + err, needle  # the stop reasons on stderr, the table's rows on stdout
    # the complete table: every flag of the train.py command has its row
    command = read_script(str(path), assume=Assumptions.parse(["NVLINK_COUNT=0"]))
    table = out[out.index("slime/Megatron flags") :]
    for flag in {t.split("=")[0] for t in command.argv if t.startswith("--")}:
        assert re.search(rf"\| {re.escape(flag)}( |$)", table, re.M), flag
    counts = re.search(r"^counts: (.*)$", table, re.M).group(1)
    print(f"{script}: rc {rc}; {counts}")  # the closing note pastes these
    # the checked class passes for the right reason: the flags match the real model's config.json
    assert "a weight shape differs" not in out
    assert "wandb-secret-0123456789" not in out + err + (base_dir / f"{script}.yaml").read_text()


def test_ported_config_runs_alone(base_dir, capsys):
    script = FIXTURES / "scripts" / "run-qwen3-4B-debug-train-only.sh"
    assert (
        lichen.cli.main(["port-slime", str(script), "-o", "port.yaml", "--no-dry-run", "--assume", "NVLINK_COUNT=3"])
        == 0
    )
    text = (base_dir / "port.yaml").read_text()
    assert "# slime/Megatron flags" in text and "gradient-checkpointing: true" in text
    assert "runtime: ray" in text and "actor-num-gpus-per-node: 8" in text  # slime's Ray job and placement
    assert "rollout-num-engines: 4" in text  # 8 rollout GPUs / 2 per engine, as slime launches them
    assert "NCCL_NVLS_ENABLE: '1'" in text  # the runtime env, ${HAS_NVLINK} from the if/else on NVLINK_COUNT=3
    capsys.readouterr()
    assert lichen.cli.main(["train", "--config", "port.yaml", "--dry-run"]) == 0


def test_reader_sources_relative_files_arrays_arithmetic_and_env(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.sh").write_text("N=2\nMODEL_ARGS=(\n  --num-layers $((N + 1))  # three\n)\n")
    (tmp_path / "run.sh").write_text(
        'SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"\n'
        'source "${SCRIPT_DIR}/models/m.sh"\n'
        "A=(\n   --lr 1e-6\n   # --lr 2e-6\n   --wandb-key ${NOT_SET_ANYWHERE}\n   --label-key 'it''s'\n)\n"
        'ENV="{\n  \\"env_vars\\": {\\"X\\": \\"${GIVEN:-dflt}\\"}\n}"\n'
        'ray job submit --runtime-env-json="${ENV}" \\\n   -- python3 train_async.py \\\n'
        "   ${MODEL_ARGS[@]} \\\n   ${A[@]}\n"
    )
    command = read_script(str(tmp_path / "run.sh"), environ={})
    assert command.entry == "train_async.py"
    assert command.argv == ["--num-layers", "3", "--lr", "1e-6", "--wandb-key", "--label-key", "its"]
    assert command.env_vars == {"X": "dflt"}
    assert command.unset_vars == ["NOT_SET_ANYWHERE"]


def test_train_async_maps_to_the_async_loop(base_dir, capsys, tmp_path):
    text = (FIXTURES / "scripts" / "run-qwen3-4B-debug-train-only.sh").read_text()
    script = tmp_path / "scripts"
    shutil.copytree(FIXTURES / "scripts", script)
    (script / "async.sh").write_text(text.replace("python3 train.py", "python3 train_async.py"))
    lichen.cli.main(["port-slime", str(script / "async.sh"), "-o", "a.yaml", "--assume", "HAS_NVLINK=0"])
    out, err = capsys.readouterr()
    assert "mapped | train_async.py | lichen train --async" in out, out
    assert "train_async.py" not in err  # no longer a reason to stop


def test_script_without_a_train_command_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "x.sh").write_text("echo hello\n")
    assert lichen.cli.main(["port-slime", str(tmp_path / "x.sh")]) == 2
    assert "no `python3 train.py ...`" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="cannot read the script"):
        read_script(os.fspath(tmp_path / "missing.sh"))


@pytest.mark.parametrize("script", ["run-qwen3-4B", "run-glm4-9B"])
def test_ref_load_is_hf_checkpoint_drops_the_torch_dist_reference(base_dir, capsys, script):
    """slime's --ref-load is the --hf-checkpoint model converted to torch_dist: said so, the config leaves it out
    (lichen's reference and starting weights are then the HF model), a row says why, and the dry run passes."""
    path = FIXTURES / "scripts" / f"{script}.sh"
    argv = ["port-slime", str(path), "-o", "x.yaml", "--assume", "NVLINK_COUNT=0"]
    assert lichen.cli.main(argv) == 2
    assert "lichen port-slime --ref-load-is-hf-checkpoint" in capsys.readouterr().err
    assert lichen.cli.main([*argv, "--ref-load-is-hf-checkpoint"]) == 0
    out = capsys.readouterr().out
    assert re.search(
        r"^ *mapped \| --ref-load .*\| \(left out: the --hf-checkpoint model\) \| port-slime", out, re.M
    ), out
    assert "ref-load" not in "".join(
        line for line in (base_dir / "x.yaml").read_text().splitlines(keepends=True) if not line.startswith("#")
    )
