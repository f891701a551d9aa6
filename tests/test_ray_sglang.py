"""SGLang engines on Ray (`--runtime ray --rollout-engine-backend sglang`, lichen.cluster.engine_actors): the
command and environment each engine's actor gives its server (pure functions), and two tensor-parallel engines
started by Ray actors against the stand-in `sglang.launch_server` of tests/helpers/fake_sglang.py (no GPU, no
SGLang needed). What only a GPU shows (SGLang's own start-up, NCCL, memory) is untested here: docs/runtimes.md."""

from __future__ import annotations

import json
import os
import urllib.request

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'lichen[ray]')")

from helpers.fake_sglang import write_fake_sglang  # noqa: E402
from helpers.ray_local import own_ray  # noqa: E402
from helpers.runs import base_args  # noqa: E402

from lichen.cli import main  # noqa: E402
from lichen.cluster.engine_actors import RayEngineSet, engine_env, sglang_command  # noqa: E402
from lichen.cluster.runtime import RayCluster  # noqa: E402
from lichen.config import parse_train_args  # noqa: E402
from lichen.config.cluster_config import ClusterConfig  # noqa: E402
from lichen.config.engine_config import EngineConfig  # noqa: E402
from lichen.engines.api.auth import SERVE_ADMIN_KEY_ENV, SERVE_KEY_ENV  # noqa: E402

pytestmark = pytest.mark.e2e  # see the marker in pyproject.toml: make test leaves it to make test-e2e

LAYOUT = [
    "--runtime",
    "ray",
    "--rollout-engine-backend",
    "sglang",
    "--rollout-num-gpus",
    "4",
    "--rollout-num-gpus-per-engine",
    "2",
    "--debug-rollout-only",
    "--sglang-mem-fraction-static",
    "0.7",
]


def _engine_cfg(tiny_ckpt, addition_data, tmp_path) -> EngineConfig:
    argv = base_args(tiny_ckpt, addition_data, tmp_path / "o", "--num-rollout", "1", *LAYOUT)
    return EngineConfig.from_args(parse_train_args(argv[1:]))


def test_an_engine_actor_starts_sglang_at_gpu_0_of_its_own_gpus(tiny_ckpt, addition_data, tmp_path):
    cfg = _engine_cfg(tiny_ckpt, addition_data, tmp_path)
    assert cfg.num_engines == 2 and cfg.gpus_per_engine == 2
    # the same command for every engine: each server sees only its engine's GPUs
    assert sglang_command(cfg, port=31000, host="10.0.0.7", python="PY") == [
        "PY",
        "-m",
        "sglang.launch_server",
        "--model-path",
        tiny_ckpt,
        "--host",
        "10.0.0.7",
        "--port",
        "31000",
        "--tp-size",
        "2",
        "--base-gpu-id",
        "0",
        "--random-seed",
        "1234",
        "--dtype",
        "float32",
        "--mem-fraction-static",
        "0.7",
    ]
    assert engine_env({SERVE_KEY_ENV: "k"}, [6, 7]) == {SERVE_KEY_ENV: "k", "CUDA_VISIBLE_DEVICES": "6,7"}


def test_ray_with_sglang_engines_resolves_the_layout(tiny_ckpt, addition_data, tmp_path, capsys):
    assert main(base_args(tiny_ckpt, addition_data, tmp_path, "--dry-run", "--num-rollout", "1", *LAYOUT)) == 0
    out = capsys.readouterr().out
    assert "rollout_num_engines: 2" in out and "rollout_engine_backend: sglang" in out


@pytest.fixture(scope="module")
def ray_with_fake_sglang(tmp_path_factory):
    # Ray's workers inherit this environment: `python -m sglang.launch_server` in an engine actor runs the fake
    fake = tmp_path_factory.mktemp("fake_sglang")
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "FAKE_SGLANG_DIR")}
    os.environ.update(write_fake_sglang(fake))
    own_ray()  # its workers must inherit the stand-in sglang package: a Ray of its own
    ray.init(
        address="local",
        num_cpus=4,
        num_gpus=4,
        include_dashboard=False,
        object_store_memory=100 * 1024 * 1024,
        log_to_driver=False,
    )
    yield fake
    ray.shutdown()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.mark.slow
def test_two_tensor_parallel_sglang_engines_started_by_ray_actors(
    ray_with_fake_sglang, tiny_ckpt, addition_data, tmp_path
):
    cfg = _engine_cfg(tiny_ckpt, addition_data, tmp_path)
    cluster = RayCluster(
        ClusterConfig(
            ray_address=None,
            actor_num_nodes=1,
            actor_num_gpus_per_node=1,
            rollout_num_gpus=4,
            rollout_num_gpus_per_engine=2,
            colocate=False,
            debug_rollout_only=True,
            debug_train_only=False,
            external_engines=False,
            device="cpu",
            train_env_vars={},
        )
    )
    engines = RayEngineSet(cluster, cfg)
    try:
        assert engines.admin_api_key is None  # SGLang takes its one key on every endpoint
        seen = engines.call_each("where")
        urls = engines.start()
        assert len(urls) == 2
        for url in urls:
            with urllib.request.urlopen(url + "/model_info", timeout=30) as r:
                assert json.load(r)["model_path"] == tiny_ckpt
        argvs = []
        for name in os.listdir(ray_with_fake_sglang):
            if name.startswith("pid_"):
                with open(ray_with_fake_sglang / name) as f:
                    argvs.append(json.load(f))
        assert len(argvs) == 2
        for argv in argvs:
            opt = dict(zip(argv, argv[1:]))
            assert opt["--tp-size"] == "2" and opt["--base-gpu-id"] == "0" and opt["--host"] == "127.0.0.1"
            assert opt["--api-key"] == engines.api_key  # the run's key, through the environment, not ps
        # each engine's actor sits on its first bundle; its server gets the GPUs of both of its bundles
        assert [w["cuda_visible_devices"] for w in seen] == [str(g) for g in cluster.gpu_ids((0, 2))]
        for i, pid in enumerate(engines.call_each("server_pid")):
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(v.split("=", 1) for v in f.read().decode().split("\0") if "=" in v)
            bundles = cluster.placement.engines[i]
            assert env["CUDA_VISIBLE_DEVICES"] == ",".join(str(g) for g in cluster.gpu_ids(bundles))
            assert SERVE_ADMIN_KEY_ENV not in env
    finally:
        engines.stop()
        cluster.close()


def test_the_8_gpu_qwen3_example_resolves(tiny_ckpt, addition_data, tmp_path):
    """examples/ray_gpu_qwen3_8gpus.sh with DRY_RUN=1 (any machine): every flag parses and the layout is the one its
    header describes."""
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {
        **os.environ,
        "DRY_RUN": "1",
        "DEVICE": "cpu",
        "MODEL_DIR": tiny_ckpt,
        "DATA": addition_data,
        "EVAL_DATA": addition_data,
        "WORK": str(tmp_path),
        "LICHEN": os.path.join(os.path.dirname(sys.executable), "lichen"),
    }
    run = subprocess.run(
        ["bash", os.path.join(repo, "examples", "ray_gpu_qwen3_8gpus.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    resolved = dict(line.split(": ", 1) for line in run.stdout.splitlines() if ": " in line)
    assert {
        k: resolved[k]
        for k in (
            "runtime",
            "colocate",
            "actor_num_gpus_per_node",
            "rollout_num_gpus",
            "rollout_num_engines",
            "rollout_num_gpus_per_engine",
            "rollout_engine_backend",
            "offload_train",
            "offload_rollout",
            "update_weight_transport",
        )
    } == {
        "runtime": "ray",
        "colocate": "true",
        "actor_num_gpus_per_node": "8",
        "rollout_num_gpus": "8",
        "rollout_num_engines": "4",
        "rollout_num_gpus_per_engine": "2",
        "rollout_engine_backend": "sglang",
        "offload_train": "true",
        "offload_rollout": "true",
        "update_weight_transport": "disk",
    }
