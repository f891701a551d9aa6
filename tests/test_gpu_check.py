"""scripts/gpu_check.sh --dry-run on this CPU machine: it prints every check's command and the table's rows as
"planned", exits 0, and each `lichen train` command it would run on a GPU resolves with `lichen train --dry-run`
(with `--device cpu` in place of `--device cuda`, which a CPU torch refuses) to the layout the check is for.

The script itself needs a GPU for anything else; docs/runtimes.md#what-a-gpu-is-needed-for.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lichen.cli import main

ROOT = Path(__file__).resolve().parents[1]
CHECKS = (
    "train_cuda_bf16",
    "memory_saver",
    "tensor_ipc",
    "nccl_sync",
    "sglang_install",
    "sglang_engine",
    "packed_attention",
)

# What each check's run must resolve to: the GPU path it exists for.
EXPECTED = {
    "train_cuda_bf16": {"bf16": True, "runtime": "local"},
    "memory_saver": {"runtime": "ray", "colocate": True, "offload_train": True, "update_weight_transport": "disk"},
    "tensor_ipc": {"runtime": "local", "colocate": True, "update_weight_transport": "tensor"},
    "nccl_sync": {"runtime": "ray", "colocate": False, "update_weight_transport": "nccl"},
    "sglang_engine": {"rollout_engine_backend": "sglang", "update_weight_transport": "disk"},
}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    work = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "WORK": str(work), "LICHEN_VENV": str(Path(sys.executable).parent.parent)}
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return work, proc.stdout


def commands(out: str) -> dict[str, list[str]]:
    return {m[1]: shlex.split(m[2]) for m in re.finditer(r"^command\[(\w+)\]: (.*)$", out, re.M)}


@pytest.mark.slow
def test_dry_run_prints_every_check_as_planned_and_its_command(dry_run: tuple[Path, str]) -> None:
    work, out = dry_run
    rows = {m[1]: m[2].strip() for m in re.finditer(r"^\| (\w+)\s+\| ([^|]+)\|", out, re.M)}
    assert rows.pop("check") == "result"
    assert list(rows) == ["setup", *CHECKS]
    assert all(r.startswith("planned") for r in rows.values()), rows
    assert set(commands(out)) >= set(CHECKS)
    # the dry run prepared the inputs the commands name, so the commands below resolve against real files
    assert (work / "model" / "config.json").is_file() and (work / "train.jsonl").stat().st_size > 0


@pytest.mark.parametrize("check", sorted(EXPECTED))
def test_each_lichen_command_resolves(
    dry_run: tuple[Path, str], check: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _, out = dry_run
    cmd = commands(out)[check]
    assert Path(cmd[0]).name == "lichen" and cmd[1] == "train", cmd
    args = cmd[2:]
    assert args[args.index("--device") + 1] == "cuda"  # on the GPU it runs on CUDA ...
    args[args.index("--device") + 1] = "cpu"  # ... which this torch refuses, so the same flags on cpu
    capsys.readouterr()
    assert main(["train", "--dry-run", *args]) == 0, capsys.readouterr().err
    resolved = yaml.safe_load(capsys.readouterr().out)
    for key, value in {"bf16": True, "num_rollout": 3, **EXPECTED[check]}.items():
        assert resolved[key] == value, (check, key, resolved[key])


def test_unknown_argument_is_refused() -> None:
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--gpu"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown argument '--gpu'" in proc.stderr


def test_the_packed_attention_command_parses(dry_run: tuple[Path, str]) -> None:
    from lichen_bench import packed_attn

    cmd = commands(dry_run[1])["packed_attention"]
    assert Path(cmd[0]).name == "lichen" and cmd[1:3] == ["bench", "packed"], cmd
    args = packed_attn.parse_args(cmd[3:])
    assert (args.device, args.dtype) == ("cuda", "bfloat16")
