"""Secrets never leak: one redaction rule (lichen.observe.secrets) for --dry-run, config.json, W&B, logs and errors.

The end-to-end test plants keys (--wandb-key, a remote RM key from the environment, an HF token in
--train-env-vars) into a real `lichen train` run with TensorBoard and offline W&B, a reward server that echoes the
key in its errors, checkpoints and rollout dumps, and then greps stdout, stderr and every file the run wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lichen.config import build_train_parser
from lichen.observe.secrets import (
    REDACTED,
    forget_secrets,
    is_secret_name,
    redact_argv,
    redact_config,
    redact_text,
    register_secrets,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "name",
    [
        "wandb_key",
        "--wandb-key",
        "rollout_external_engine_api_key",
        "WANDB_API_KEY",
        "HF_TOKEN",
        "hf_token",
        "LICHEN_RM_API_KEY",
        "db_password",
        "client_secret_file",
        "AWS_SECRET_ACCESS_KEY",
        "apikey",
        "key",
        "token",
        "--sglang-admin-api-key",
        "engine_keys",
        "OPENAI_API_KEY",
        "credentials",
    ],
)
def test_secret_names(name):
    assert is_secret_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "input_key",
        "label_key",
        "metadata_key",
        "tool_key",
        "reward_key",
        "eval_reward_key",
        "rollout_stop_token_ids",
        "max_tokens_per_gpu",
        "calculate_per_token_loss",
        "rollout_external_engine_api_key_file",
        "rm_api_key_file",
        "sglang_passthrough",
        "pad_token",
        "TOKENIZERS_PARALLELISM",
        "wandb_project",
        "",
    ],
)
def test_names_that_are_not_secrets(name):
    assert not is_secret_name(name)


def test_redact_config_nested_and_argv_lists():
    config = {
        "wandb_key": "k-wandb-0001",
        "label_key": "answer",
        "tool_key": None,
        "rm_api_key_file": "/run/key",
        "train_env_vars": {"HF_TOKEN": "hf-tok-0002", "OMP_NUM_THREADS": "1"},
        "sglang_passthrough": ["--sglang-hf-token", "hf-tok-0003", "--sglang-x-secret=s-0004", "--sglang-tp", "2"],
        "eval_datasets": [{"name": "a", "api_key": "k-0005", "input_key": "q"}],
        "empty_api_key": None,
    }
    out = redact_config(config)
    assert out == {
        "wandb_key": REDACTED,
        "label_key": "answer",
        "tool_key": None,
        "rm_api_key_file": "/run/key",
        "train_env_vars": {"HF_TOKEN": REDACTED, "OMP_NUM_THREADS": "1"},
        "sglang_passthrough": ["--sglang-hf-token", REDACTED, f"--sglang-x-secret={REDACTED}", "--sglang-tp", "2"],
        "eval_datasets": [{"name": "a", "api_key": REDACTED, "input_key": "q"}],
        "empty_api_key": None,
    }
    assert config["wandb_key"] == "k-wandb-0001"  # a copy: the run itself still has its keys


def test_registered_secrets_are_scrubbed_from_text_and_argv(monkeypatch):
    forget_secrets()
    try:
        register_secrets(
            {"wandb_key": "k-wandb-0001", "rollout_external_engine_api_key": "abc"},
            environ={"MY_SERVICE_TOKEN": "env-tok-0006", "HOME": "/root-home-dir"},
        )
        assert redact_text("sent k-wandb-0001 and env-tok-0006 from /root-home-dir") == (
            f"sent {REDACTED} and {REDACTED} from /root-home-dir"
        )
        assert redact_text("abc stays: too short to search for in free text").startswith("abc")
        assert redact_argv(["lichen", "train", "--wandb-key", "k-wandb-0001", "--x-password=pw", "--lr", "1"]) == [
            "lichen",
            "train",
            "--wandb-key",
            REDACTED,
            f"--x-password={REDACTED}",
            "--lr",
            "1",
        ]
    finally:
        forget_secrets()


def _secret_string_flags() -> list[str]:
    """Every `lichen train` flag whose name the rule calls secret and that takes one string value."""
    flags = []
    for action in build_train_parser()._actions:
        for flag in action.option_strings:
            if flag.startswith("--") and is_secret_name(flag) and action.nargs is None and action.type in (None, str):
                flags.append(flag)
                break
    return flags


def test_dry_run_redacts_every_secret_flag(tiny_ckpt, addition_data, capsys):
    from lichen.cli import main

    flags = _secret_string_flags()
    assert "--wandb-key" in flags  # the rule reaches the flags that exist; new ones are covered as they come
    argv = [
        "train",
        "--hf-checkpoint",
        tiny_ckpt,
        "--prompt-data",
        addition_data,
        "--rm-type",
        "leading_number",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--num-rollout",
        "1",
        "--dry-run",
        "--train-env-vars",
        json.dumps({"HF_TOKEN": "planted-env-0000"}),
        "--rollout-engine-backend",
        "sglang",
        "--rollout-num-engines",
        "1",
        "--sglang-hf-token",
        "planted-sg-0000",
    ]
    planted = {"planted-env-0000", "planted-sg-0000"}
    for i, flag in enumerate(flags):
        argv += [flag, f"planted-flag-{i:04d}"]
        planted.add(f"planted-flag-{i:04d}")
    saved = list(sys.argv)
    try:
        assert main(argv) == 0
    finally:
        sys.argv[:] = saved
        forget_secrets()
    out, err = capsys.readouterr()
    assert "wandb_key: <redacted>" in out and "HF_TOKEN: <redacted>" in out
    for secret in planted:
        assert secret not in out and secret not in err


class _RewardServer(BaseHTTPRequestHandler):
    """A remote RM that needs the key; for odd labels it answers HTTP 400 echoing the key (a careless server)."""

    key = ""
    seen: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        auth = self.headers.get("Authorization", "")
        type(self).seen.append(auth == f"Bearer {self.key}")
        if auth != f"Bearer {self.key}":
            status, text = 401, "no key"
        elif int(body["label"]) % 2:
            status, text = 400, f"cannot grade this one (you sent {auth})"
        else:
            status, text = 200, "1.0"
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(text.encode())

    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_planted_keys_appear_in_no_output_of_a_run(tiny_ckpt, addition_data, tmp_path):
    keys = {
        "wandb": "planted-wandb-key-0123456789abcdef0123456789ab",
        "rm": "planted-rm-key-5b1e7c",
        "hf": "planted-hf-token-77aa",
    }
    _RewardServer.key, _RewardServer.seen = keys["rm"], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RewardServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    out = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "lichen.cli",
        "train",
        "--hf-checkpoint",
        tiny_ckpt,
        "--prompt-data",
        addition_data,
        "--rm-type",
        "remote_rm",
        "--rm-url",
        f"http://127.0.0.1:{server.server_port}/score",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "2",
        "--rollout-max-response-len",
        "4",
        "--num-rollout",
        "2",
        "--output-dir",
        str(out),
        "--no-progress",
        "--save",
        str(out / "ckpt"),
        "--save-debug-rollout-data",
        str(out / "dump_{rollout_id}.pt"),
        "--use-tensorboard",
        "--use-wandb",
        "--wandb-mode",
        "offline",
        "--wandb-key",
        keys["wandb"],
        "--train-env-vars",
        json.dumps({"HF_TOKEN": keys["hf"]}),
    ]
    env = {**os.environ, "LICHEN_RM_API_KEY": keys["rm"], "WANDB_SILENT": "true", "PYTHONPATH": REPO}
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, timeout=600)
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    # the run really used the keys: the reward server saw the RM key, its echo reached the failure log redacted
    assert _RewardServer.seen and all(_RewardServer.seen)
    assert b"cannot grade this one (you sent Bearer <redacted>)" in proc.stderr
    files = [os.path.join(d, f) for d, _, names in os.walk(out) for f in names]
    assert any("tfevents" in f for f in files) and any(f.endswith(".wandb") for f in files)
    assert any(f.endswith("config.json") for f in files) and any("dump_" in f for f in files)
    outputs = {"stdout": proc.stdout, "stderr": proc.stderr}
    for path in files:
        with open(path, "rb") as f:
            outputs[path] = f.read()
    for name, secret in keys.items():
        leaks = [where for where, data in outputs.items() if secret.encode() in data]
        assert not leaks, f"the {name} key leaked into {leaks}"
    config = json.loads((out / "config.json").read_text())
    assert config["wandb_key"] == REDACTED and config["train_env_vars"] == {"HF_TOKEN": REDACTED}


def test_remote_rm_key_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    from lichen.rewards.remote_rm import RM_KEY_ENV, RemoteRM, rm_api_key

    monkeypatch.delenv(RM_KEY_ENV, raising=False)
    assert rm_api_key(None) is None
    monkeypatch.setenv(RM_KEY_ENV, "rm-env-key-0007")
    assert rm_api_key(None) == "rm-env-key-0007"
    key_file = tmp_path / "rm.key"
    key_file.write_text("rm-file-key-0008\n")
    key_file.chmod(0o600)
    assert rm_api_key(str(key_file)) == "rm-file-key-0008"
    forget_secrets()
    try:
        rm = RemoteRM("http://127.0.0.1:9/score", api_key="rm-file-key-0008")
        assert rm._headers == {"Authorization": "Bearer rm-file-key-0008"}
        assert redact_text("echo: rm-file-key-0008") == f"echo: {REDACTED}"  # registered once read
    finally:
        forget_secrets()
