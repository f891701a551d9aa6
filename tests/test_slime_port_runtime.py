"""`lichen port-slime`: the script evaluated for the environment, a `--runtime ray` config with slime's placement
(`--runtime local` on request), the env vars it adds listed, and nothing written when something cannot be
evaluated."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

import lichen.cli
from lichen.config import parse_train_args

FIXTURES = Path(__file__).parent / "fixtures" / "slime"
SCRIPT = """\
NVLINK_COUNT=$(nvidia-smi topo -m 2>/dev/null | grep -o 'NV[0-9]*' | wc -l)
if [ "$NVLINK_COUNT" -gt 0 ]; then HAS_NVLINK=1; else HAS_NVLINK=0; fi
NUM_GPUS=${NUM_GPUS:-8}
if [ "$NUM_GPUS" -ge 8 ]; then PER_ENGINE=2; else PER_ENGINE=2; fi
ray job submit --address="http://127.0.0.1:8265" \\
   --runtime-env-json="{\\"env_vars\\": {\\"NCCL_NVLS_ENABLE\\": \\"${HAS_NVLINK}\\"}}" \\
   -- python3 train.py \\
   --hf-checkpoint $BASE_DIR/tiny --prompt-data $BASE_DIR/data.jsonl --input-key prompt --label-key label \\
   --rm-type math --num-rollout 1 --rollout-batch-size 2 --n-samples-per-prompt 2 --global-batch-size 4 \\
   --actor-num-nodes 1 --actor-num-gpus-per-node $NUM_GPUS --rollout-num-gpus $NUM_GPUS \\
   --rollout-num-gpus-per-engine $PER_ENGINE --colocate
"""


@pytest.fixture
def base_dir(tmp_path, monkeypatch):
    shutil.copytree(FIXTURES / "hf" / "Qwen3-4B", tmp_path / "tiny")
    for f in (FIXTURES / "tokenizer").iterdir():
        shutil.copy(f, tmp_path / "tiny" / f.name)
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1?", "label": "2"}\n')
    (tmp_path / "run.sh").write_text(SCRIPT)
    monkeypatch.setenv("BASE_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_num_gpus_4_gives_a_ray_config_with_4_gpus_and_2_engines(base_dir, capsys, monkeypatch):
    monkeypatch.setenv("NUM_GPUS", "4")
    rc = lichen.cli.main(["port-slime", "run.sh", "-o", "p.yaml", "--assume", "NVLINK_COUNT=0", "--no-dry-run"])
    assert rc == 0, capsys.readouterr().err
    config = yaml.safe_load((base_dir / "p.yaml").read_text())
    assert config["runtime"] == "ray" and config["rollout-engine-backend"] == "sglang"
    assert (config["actor-num-nodes"], config["actor-num-gpus-per-node"], config["rollout-num-gpus"]) == (1, 4, 4)
    assert config["colocate"] is True and config["rollout-num-gpus-per-engine"] == 2
    args = parse_train_args(["--config", "p.yaml", "--dry-run"])  # the placement lichen resolves from it
    assert (args.actor_num_gpus_per_node, args.rollout_num_gpus, args.rollout_num_engines) == (4, 4, 2)
    out = capsys.readouterr().out
    assert "mapped | (runtime) | --runtime ray | slime runs train.py as a Ray job" in out


def test_env_vars_the_config_adds_are_listed(base_dir, capsys):
    assert lichen.cli.main(["port-slime", "run.sh", "-o", "p.yaml", "--assume", "HAS_NVLINK=1", "--no-dry-run"]) == 0
    out = capsys.readouterr().out
    assert "environment variables the config adds (train-env-vars, from --runtime-env-json at run.sh:5):" in out
    assert "  NCCL_NVLS_ENABLE=1" in out
    assert yaml.safe_load((base_dir / "p.yaml").read_text())["train-env-vars"] == {"NCCL_NVLS_ENABLE": "1"}
    # a script whose ray job sets no env var: none is added, and the report says so
    (base_dir / "run.sh").write_text(SCRIPT.replace("--runtime-env-json=", "--no-env="))
    assert lichen.cli.main(["port-slime", "run.sh", "-o", "q.yaml", "--no-dry-run", "--assume", "HAS_NVLINK=1"]) == 0
    assert "environment variables the config adds: none" in capsys.readouterr().out
    assert "NCCL" not in (base_dir / "q.yaml").read_text() and "train-env-vars" not in (base_dir / "q.yaml").read_text()


def test_runtime_local_on_request(base_dir, capsys):
    rc = lichen.cli.main(
        ["port-slime", "run.sh", "-o", "l.yaml", "--runtime", "local", "--assume", "NVLINK_COUNT=2", "--no-dry-run"]
    )
    assert rc == 0
    config = yaml.safe_load((base_dir / "l.yaml").read_text())
    assert "runtime" not in config and "actor-num-gpus-per-node" not in config
    assert config["rollout-num-engines"] == 4  # 8 GPUs / 2 per engine, in one process's engine servers
    assert "mapped | (runtime) | --runtime local | asked for with port-slime --runtime local" in capsys.readouterr().out


def test_unevaluable_script_writes_nothing_and_exits_2(base_dir, capsys):
    assert lichen.cli.main(["port-slime", "run.sh", "-o", "p.yaml"]) == 2
    err = capsys.readouterr().err
    assert "nothing written; port-slime cannot evaluate:" in err
    [line] = [x for x in err.splitlines() if x.startswith("  ")]  # one line per cause
    assert "run.sh:5:" in line and "nvidia-smi topo -m" in line and "--assume NVLINK_COUNT=VALUE" in line
    assert not (base_dir / "p.yaml").exists()
