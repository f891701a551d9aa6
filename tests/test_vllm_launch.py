"""`--rollout-engine-backend vllm` without starting vLLM: the exact command and environment of a launched server,
the --vllm-* pass-through rules, the interpreter lookup, what a vLLM run refuses at start (one line, exit 2), the
SGLang -> vLLM request translation, and the key guard as an ASGI app (the real server: tests/test_vllm_protocol.py).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import stat
import sys

import pytest
from helpers.runs import base_args
from helpers.vllm import vllm_tiny_model

from lichen.cli import main
from lichen.config import parse_train_args
from lichen.config.engine_config import EngineConfig
from lichen.engines.clients.client import generate_payload
from lichen.engines.clients.vllm_client import sglang_output, vllm_generate_body
from lichen.engines.clients.vllm_guard import KeyGuard
from lichen.engines.clients.vllm_launcher import (
    CPU_KV_CACHE_BYTES,
    PYTHON_ENV,
    RECEIVER,
    VLLMLauncher,
    build_vllm_command,
    engine_gpus,
    resolve_python,
)
from lichen.engines.clients.vllm_worker_ext import WEIGHT_DIRS_ENV
from lichen.engines.core.engine import GenRequest
from lichen.errors import ConfigError

pytestmark = pytest.mark.e2e  # see the marker in pyproject.toml: make test leaves it to make test-e2e


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return vllm_tiny_model(str(tmp_path_factory.mktemp("vllm_tiny")))


def _argv(ckpt, data, tmp_path, *extra):
    return base_args(ckpt, data, tmp_path / "o", "--num-rollout", "1", "--rollout-engine-backend", "vllm", *extra)


def _cfg(ckpt, data, tmp_path, *extra) -> EngineConfig:
    return EngineConfig.from_args(parse_train_args(_argv(ckpt, data, tmp_path, *extra)[1:]))


def _python(tmp_path) -> str:
    path = tmp_path / "py"
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_exact_command_from_lichen_flags_and_passthrough(ckpt, addition_data, tmp_path, monkeypatch):
    monkeypatch.setattr("lichen.engines.clients.vllm_launcher._cuda_here", lambda: False)
    cfg = _cfg(
        ckpt,
        addition_data,
        tmp_path,
        "--rollout-num-engines",
        "1",
        "--rollout-max-batch-size",
        "8",
        "--vllm-max-model-len",
        "512",
        "--vllm-enforce-eager",
    )
    assert build_vllm_command(cfg, port=31000, python="PY") == [
        "PY", "-m", "vllm.entrypoints.openai.api_server", "--model", ckpt, "--host", "127.0.0.1",
        "--port", "31000", "--seed", "1234", "--dtype", "float32", "--tensor-parallel-size", "1",
        "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm", "--enable-scale-out",
        "--middleware", "lichen.engines.clients.vllm_guard.KeyGuard", "--worker-extension-cls", RECEIVER, "--max-num-seqs", "8",
        "--kv-cache-memory-bytes", str(CPU_KV_CACHE_BYTES), "--no-enable-chunked-prefill",
        "--max-model-len", "512", "--enforce-eager",
    ]  # fmt: skip
    # on CPU a prompt is never prefilled in chunks (vLLM 0.32's CPU build crashes on a chunked seeded request),
    # unless the user sizes the steps or chunking
    for extra, chunking_off in (
        ([], True),
        (["--vllm-max-num-batched-tokens", "256"], False),
        (["--vllm-enable-chunked-prefill"], False),
    ):
        cmd = build_vllm_command(
            _cfg(ckpt, addition_data, tmp_path, "--rollout-num-engines", "1", *extra), port=1, python="PY"
        )
        assert ("--no-enable-chunked-prefill" in cmd) == chunking_off


def test_launcher_environment_keeps_the_key_off_the_command_line(ckpt, addition_data, tmp_path, monkeypatch):
    weights = tmp_path / "weights"
    cfg = _cfg(
        ckpt, addition_data, tmp_path, "--rollout-num-engines", "2", "--vllm-python", _python(tmp_path),
        "--update-weight-transport", "disk", "--update-weight-disk-dir", str(weights),
    )  # fmt: skip
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    launcher = VLLMLauncher.from_config(cfg)
    assert launcher.api_key and launcher.env["VLLM_API_KEY"] == launcher.api_key
    assert launcher.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert launcher.env[WEIGHT_DIRS_ENV] == str(weights)  # the only directory its receiver loads from
    linked = os.path.join(launcher.env["PYTHONPATH"].split(os.pathsep)[0], "lichen")
    assert os.path.isfile(os.path.join(linked, "engines", "clients", "vllm_guard.py"))
    cmd = launcher.command_for(1, 31001)
    assert cmd[1] == "CUDA_VISIBLE_DEVICES=5" and launcher.api_key not in " ".join(cmd)
    assert launcher.keyed(cmd) == cmd
    assert engine_gpus(1, 2, None) == "2,3" and engine_gpus(0, 1, "7") == "7"
    # vLLM's sockets go to the launcher's own directory, removed with it even when stop() is never called
    scratch = launcher.scratch
    assert launcher.env["VLLM_RPC_BASE_PATH"] == os.path.join(scratch, "rpc") and os.path.isdir(scratch)
    assert launcher.env["TMPDIR"] == os.path.join(scratch, "tmp")
    del launcher
    gc.collect()
    assert not os.path.exists(scratch)


def test_the_interpreter_comes_from_the_flag_the_environment_or_a_hint(tmp_path, monkeypatch):
    py = _python(tmp_path)
    assert resolve_python(py) == py
    monkeypatch.setenv(PYTHON_ENV, py)
    assert resolve_python(None) == py
    monkeypatch.setenv(PYTHON_ENV, str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match=r"\$LICHEN_VLLM_PYTHON .*nope: not an executable file; .*setup_vllm.sh"):
        resolve_python(None)
    monkeypatch.delenv(PYTHON_ENV)
    monkeypatch.setattr(
        "lichen.engines.clients.vllm_launcher.default_python", lambda: str(tmp_path / "none" / "python")
    )
    with pytest.raises(ConfigError, match="no vLLM environment at .*setup_vllm.sh"):
        resolve_python(None)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--rollout-num-engines", "1", "--vllm-port", "1"], "lichen sets vLLM's --port itself"),
        (["--rollout-num-engines", "1", "--vllm-logprobs-mode=raw_logprobs"], "lichen sets vLLM's --logprobs-mode"),
        (["--rollout-num-engines", "1", "--vllm-middleware", "x.Y"], "its key guard"),
        (
            ["--rollout-num-engines", "1", "--rollout-max-batch-size", "4", "--vllm-max-num-seqs", "4"],
            "both set vLLM's --max-num-seqs",
        ),
        (["--rollout-num-engines", "1", "--sglang-mem-fraction-static", "0.5"], "use --vllm-"),
        (["--rollout-num-engines", "1", "--rollout-top-p", "0.9"], "sampling-mask replay"),
        (["--rollout-num-engines", "1", "--rollout-top-k", "5"], "sampling-mask replay"),
        (
            [
                "--rollout-num-engines", "1", "--update-weight-transport", "disk", "--update-weight-mode", "delta",
                "--update-weight-disk-dir", "W", "--update-weight-local-checkpoint-dir", "L",
            ],
            "full checkpoints only",
        ),
        ([], "needs server engines"),
        (["--rollout-external-engine-addrs", "127.0.0.1:1", "--vllm-max-model-len", "9"], "not external ones"),
    ],
)  # fmt: skip
def test_a_vllm_run_lichen_cannot_do_is_refused_at_start(ckpt, addition_data, tmp_path, capsys, extra, message):
    assert main([*_argv(ckpt, addition_data, tmp_path, *extra), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_vllm_flags_without_the_vllm_backend_are_refused(ckpt, addition_data, tmp_path, capsys):
    argv = base_args(ckpt, addition_data, tmp_path / "o", "--rollout-num-engines", "1", "--vllm-max-model-len", "9")
    assert main([*argv, "--dry-run"]) == 2
    assert "add --rollout-engine-backend vllm" in capsys.readouterr().err


def test_a_head_size_vllms_cpu_attention_lacks_is_refused(tiny_ckpt, addition_data, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    argv = _argv(tiny_ckpt, addition_data, tmp_path, "--rollout-num-engines", "1")  # head size 16
    assert main([*argv, "--dry-run"]) == 2
    assert "head size 16 is not one vLLM's CPU attention supports" in capsys.readouterr().err


def test_a_lichen_request_becomes_vllms_and_its_answer_lichens():
    req = GenRequest([3, 4], 5, temperature=0.7, top_k=-1, stop_token_ids=[9], seed=42, ignore_eos=True)
    assert vllm_generate_body(generate_payload(req, rid="r1")) == {
        "token_ids": [3, 4],
        "request_id": "r1",
        "sampling_params": {
            "max_tokens": 5, "temperature": 0.7, "top_p": 1.0, "top_k": 0, "logprobs": 0, "detokenize": False,
            "skip_special_tokens": False, "seed": 42, "ignore_eos": True,
        },
    }  # fmt: skip
    # lichen's ignore_eos turns the stop ids off too; without it they are sent
    req.ignore_eos = False
    assert vllm_generate_body(generate_payload(req))["sampling_params"]["stop_token_ids"] == [9]
    answer = {
        "choices": [
            {
                "finish_reason": "stop",
                "token_ids": [7, 9],
                "logprobs": {"content": [{"token_id": 7, "logprob": -0.5}, {"token_id": 9, "logprob": -1.5}]},
                "weight_versions": [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 2}],
            }
        ],
        "usage": {"prompt_tokens": 2},
    }
    meta = sglang_output(answer)["meta_info"]
    assert meta["output_token_logprobs"] == [[-0.5, 7, None], [-1.5, 9, None]]
    assert meta["finish_reason"] == {"type": "stop"} and meta["weight_version"] == "4" and meta["prompt_tokens"] == 2


@pytest.mark.parametrize(
    "answer",
    [
        {"choices": []},
        {"choices": [{"token_ids": [1, 2], "logprobs": {"content": [{"token_id": 1, "logprob": -1}]}}]},
        {"choices": [{"token_ids": [1], "logprobs": {"content": [{"token_id": 2, "logprob": -1}]}}]},
        {"choices": [{"token_ids": [1], "logprobs": {"content": [{"token_id": 1, "logprob": "x"}]}}]},
        "not json",
    ],
)
def test_a_malformed_vllm_answer_is_one_clear_error(answer):
    from lichen.engines.clients.client import EngineError

    with pytest.raises(EngineError, match="/inference/v1/generate"):
        sglang_output(answer, "http://e")


def test_the_sampling_mask_is_refused_not_dropped():
    from lichen.engines.clients.client import EngineError

    payload = generate_payload(GenRequest([1], 2, top_p=0.5, return_sampling_mask=True))
    with pytest.raises(EngineError, match="sampling mask"):
        vllm_generate_body(payload)


def _asgi_status(guard: KeyGuard, path: str, method: str = "POST", auth: bytes | None = None) -> int:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    headers = [(b"authorization", auth)] if auth is not None else []
    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    asyncio.run(guard(scope, receive, send))
    return sent[0]["status"]


def test_the_key_guard_closes_every_path_but_health():
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})

    guard = KeyGuard(app, key="k1")
    assert _asgi_status(guard, "/collective_rpc") == 401
    assert _asgi_status(guard, "/collective_rpc", auth=b"Bearer k2") == 401
    assert _asgi_status(guard, "/collective_rpc", auth=b"Basic k1") == 401
    assert _asgi_status(guard, "/collective_rpc", auth=b"Bearer k1") == 200
    assert _asgi_status(guard, "/health", "GET") == 200 and _asgi_status(guard, "/metrics", "GET") == 200
    assert _asgi_status(guard, "/pause", "OPTIONS") == 200
    with pytest.raises(RuntimeError, match="VLLM_API_KEY"):
        KeyGuard(app, key="")


def test_a_ray_engine_actor_starts_one_vllm_server_on_its_gpus_with_the_run_s_key(ckpt, addition_data, tmp_path):
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'lichen[ray]')")
    from lichen.cluster.engine_actors import EngineHostImpl, engine_env
    from lichen.engines.api.auth import SERVE_KEY_ENV

    cfg = _cfg(ckpt, addition_data, tmp_path, "--rollout-num-engines", "2", "--vllm-python", _python(tmp_path))
    keys = {SERVE_KEY_ENV: "run-key"}
    actor = EngineHostImpl(cfg, 1, [6, 7], "10.0.0.1", keys)
    launcher = actor._vllm_launcher("10.0.0.7", engine_env(keys, [6, 7]), str(tmp_path / "logs"))
    assert launcher.num_engines == 1 and launcher.host == "10.0.0.7"
    assert launcher.api_key == launcher.env["VLLM_API_KEY"] == "run-key" and SERVE_KEY_ENV not in launcher.env
    assert launcher.env["CUDA_VISIBLE_DEVICES"] == "6,7"  # the actor's GPUs; no per-engine slicing on top
    cmd = launcher.command_for(0, 31000)
    assert cmd[0] == _python(tmp_path) and cmd[cmd.index("--host") + 1] == "10.0.0.7" and "run-key" not in cmd


# ---- readiness: /health, then one generate with its log-prob ---------------------------------------------------
STUB_VLLM = r"""
import json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, code, obj):
        raw = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):
        self._send(200, {})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(os.environ["STUB_RECORD"], "a") as f:
            f.write(json.dumps({"path": self.path, "auth": self.headers.get("Authorization"), "body": body}) + "\n")
        if os.environ.get("STUB_FAIL"):
            self._send(500, {"error": "the log-prob gather did not compile"})
        else:
            self._send(200, {"choices": [{"token_ids": [3], "logprobs": {"content": [{"token_id": 3, "logprob": -1.0}]}}]})

ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.mark.parametrize("fail", [False, True])
def test_a_launched_vllm_server_is_ready_after_a_first_generate_with_its_log_prob(tmp_path, fail):
    """vLLM compiles its log-prob gather on the first request that asks for log-probs, holding every request behind
    it (30 s and more on a busy CPU: long enough for the health check to call the engine hung). The launcher makes
    that request before it calls a server (launched or restarted) ready."""
    from lichen.engines.clients.sglang_launcher import SGLangLaunchError

    script = tmp_path / "stub_vllm.py"
    script.write_text(STUB_VLLM)
    record = tmp_path / "calls.jsonl"
    env = {"STUB_RECORD": str(record), **({"STUB_FAIL": "1"} if fail else {})}
    launcher = VLLMLauncher(
        lambda i, port: [sys.executable, str(script), str(port)],
        1,
        log_dir=str(tmp_path / "logs"),
        env=env,
        keyed=True,
        poll=0.05,
        ready_timeout=60,
    )
    try:
        if fail:
            with pytest.raises(SGLangLaunchError, match="answered /health but not its first generate.*500"):
                launcher.start()
            return
        launcher.start()
        launcher.restart(0)
        calls = [json.loads(line) for line in record.read_text().splitlines()]
        assert len(calls) == 2  # at the start and at the restart
        for c in calls:
            assert c["path"] == "/inference/v1/generate" and c["auth"] == f"Bearer {launcher.api_key}"
            assert c["body"]["sampling_params"]["logprobs"] == 0 and c["body"]["sampling_params"]["max_tokens"] == 1
    finally:
        launcher.stop(grace=5)
