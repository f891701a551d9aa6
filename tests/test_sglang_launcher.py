"""The SGLang launcher: the exact command it builds from lichen's flags and the --sglang-* pass-through, the flag
rules, and its process lifecycle (start, readiness on /health_generate, restart, stop of the whole process group)
against a stand-in `sglang.launch_server` module (no GPU, no SGLang needed).

FAKE_LAUNCH_SERVER is also the stand-in engine of tests/test_fault_tolerance.py: a stdlib HTTP server that speaks
the part of SGLang's protocol lichen drives, with a deterministic /generate (tokens are a function of the request's
sampling_seed and input, so a re-sent request is recognisable) that holds each request FAKE_SGLANG_DELAY seconds;
GET /server_info counts the /generate and /abort_request calls it received.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest
from helpers.fake_sglang import fake_sglang_command, write_fake_sglang
from helpers.serve_process import call
from helpers.waits import gone

from lichen.config import parse_train_args
from lichen.config.engine_config import EngineConfig
from lichen.engines.clients.sglang_launcher import (
    LICHEN_SETS,
    SGLangLauncher,
    build_sglang_command,
    check_passthrough,
    translate_passthrough,
)
from lichen.errors import ConfigError, NotAvailableYet


def _args(tiny_ckpt, addition_data, tmp_path, *extra):
    from helpers.runs import base_args

    argv = base_args(
        tiny_ckpt,
        addition_data,
        tmp_path / "o",
        "--num-rollout",
        "1",
        "--rollout-num-engines",
        "2",
        "--update-weight-transport",
        "disk",
        "--update-weight-disk-dir",
        str(tmp_path / "w"),
        *extra,
    )
    return parse_train_args(argv[1:])


# ---- the command line ------------------------------------------------------------------------------------------
def test_exact_command_from_lichen_flags_and_passthrough(tiny_ckpt, addition_data, tmp_path):
    args = _args(
        tiny_ckpt,
        addition_data,
        tmp_path,
        "--rollout-engine-backend",
        "sglang",
        "--rollout-num-gpus-per-engine",
        "2",
        "--seed",
        "7",
        "--bf16",
        "--offload-rollout",
        "--sglang-mem-fraction-static",
        "0.7",
        "--sglang-enable-deterministic-inference",
        "--sglang-cuda-graph-bs",
        "1",
        "2",
        "4",
        "--sglang-attention-backend=fa3",
        "--sglang-server-concurrency",
        "8",
    )
    assert args.sglang_server_concurrency == 8  # consumed by lichen, not passed on
    cmd = build_sglang_command(EngineConfig.from_args(args), engine_index=1, port=31001, python="PY")
    assert cmd == [
        "PY",
        "-m",
        "sglang.launch_server",
        "--model-path",
        tiny_ckpt,
        "--host",
        "127.0.0.1",
        "--port",
        "31001",
        "--tp-size",
        "2",
        "--base-gpu-id",
        "2",
        "--random-seed",
        "7",
        "--dtype",
        "bfloat16",
        "--enable-memory-saver",
        "--mem-fraction-static",
        "0.7",
        "--enable-deterministic-inference",
        "--cuda-graph-bs",
        "1",
        "2",
        "4",
        "--attention-backend=fa3",
    ]
    # engine 0, float32, no offload, the batch cap from --rollout-max-batch-size; a memory saver already passed
    # through is not added twice
    args = _args(
        tiny_ckpt, addition_data, tmp_path, "--rollout-engine-backend", "sglang", "--rollout-max-batch-size", "16"
    )
    assert build_sglang_command(EngineConfig.from_args(args), engine_index=0, port=5, python="PY") == [
        "PY",
        "-m",
        "sglang.launch_server",
        "--model-path",
        tiny_ckpt,
        "--host",
        "127.0.0.1",
        "--port",
        "5",
        "--tp-size",
        "1",
        "--base-gpu-id",
        "0",
        "--random-seed",
        "1234",
        "--dtype",
        "float32",
        "--max-running-requests",
        "16",
    ]
    args.offload_rollout, args.sglang_passthrough = True, ["--sglang-enable-memory-saver"]
    assert (
        build_sglang_command(EngineConfig.from_args(args), engine_index=0, port=5, python="PY").count(
            "--enable-memory-saver"
        )
        == 1
    )
    assert translate_passthrough(["--sglang-a", "x", "--sglang-b=1", "-3"]) == ["--a", "x", "--b=1", "-3"]


def test_flags_lichen_sets_cannot_be_passed_through(tiny_ckpt, addition_data, tmp_path):
    for flag, owner in (
        ("--sglang-model-path", "--hf-checkpoint"),
        ("--sglang-tp-size", "--rollout-num-gpus"),
        ("--sglang-tensor-parallel-size", "--rollout-num-gpus"),
        ("--sglang-port", "free port"),
        ("--sglang-dtype", "--bf16"),
        ("--sglang-random-seed", "--seed"),
    ):
        with pytest.raises(ConfigError) as info:
            _args(tiny_ckpt, addition_data, tmp_path, "--rollout-engine-backend", "sglang", flag, "1")
        msg = str(info.value)
        assert msg.startswith(f"{flag}: lichen sets SGLang's --{flag[9:]} itself") and owner in msg, msg
    with pytest.raises(ConfigError, match="--sglang-host: lichen sets"):
        check_passthrough(["--sglang-host=0.0.0.0"])
    assert set(LICHEN_SETS) >= {"--model-path", "--host", "--port", "--tp-size"}
    cases = [
        (
            [
                "--rollout-engine-backend",
                "sglang",
                "--rollout-max-batch-size",
                "8",
                "--sglang-max-running-requests",
                "4",
            ],
            ConfigError,
            "--sglang-max-running-requests and --rollout-max-batch-size both set",
        ),
        (["--sglang-mem-fraction-static", "0.7"], NotAvailableYet, "add --rollout-engine-backend sglang"),
        (["--rollout-num-gpus-per-engine", "2"], NotAvailableYet, "not available yet with lichen serve engines"),
    ]
    for extra, kind, text in cases:
        with pytest.raises(kind) as info:
            _args(tiny_ckpt, addition_data, tmp_path, *extra)
        assert text in str(info.value), str(info.value)
    from helpers.runs import base_args

    argv = base_args(
        tiny_ckpt, addition_data, tmp_path / "o", "--num-rollout", "1", "--rollout-engine-backend", "sglang"
    )
    with pytest.raises(ConfigError, match="--rollout-engine-backend sglang .* add --rollout-num-engines K"):
        parse_train_args(argv[1:])


# ---- the process lifecycle ---------------------------------------------------------------------------------------
def test_launcher_starts_restarts_and_stops_servers(tmp_path):
    env = write_fake_sglang(tmp_path)

    def command_for(i, port):
        return [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            f"/m{i}",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--tp-size",
            "1",
        ]

    launcher = SGLangLauncher(command_for, 2, log_dir=str(tmp_path / "logs"), env=env, poll=0.05, ready_timeout=60)
    try:
        urls = launcher.start()
        assert len(set(urls)) == 2 and launcher.alive() == [True, True]
        for i, url in enumerate(urls):
            assert call(url + "/model_info")[1]["model_path"] == f"/m{i}"
            port = url.rsplit(":", 1)[1]
            with open(tmp_path / f"pid_{launcher.pids[i]}") as f:  # the server got exactly the built command
                assert json.load(f) == command_for(i, int(port))[3:]
        old_pid = launcher.pids[0]
        new_url = launcher.restart(0)
        assert launcher.pids[0] != old_pid and gone(old_pid) and call(new_url + "/health_generate")[0] == 200
        log = (tmp_path / "logs" / "engine_0.log").read_text()
        assert log.count("[lichen] starting:") == 2 and log.count("ARGV ") == 2  # appended across the restart
    finally:
        launcher.stop(grace=5)
    assert launcher.alive() == [False, False]

    def failing(i, port):
        return [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"]

    with pytest.raises(Exception, match="exited with code 3") as info:
        SGLangLauncher(failing, 1, log_dir=str(tmp_path / "bad"), poll=0.05).start()
    assert "boom" in str(info.value)  # the log tail is in the message


def test_stop_takes_the_servers_children_down(tmp_path):
    """SGLang forks scheduler processes: stopping the launcher stops the whole process group."""
    child_pid = tmp_path / "child"
    script = (
        f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
        f"time.sleep(300)']); open({str(child_pid)!r}, 'w').write(str(p.pid)); "
        "sys.argv = [sys.argv[0]] + sys.argv[1:]; import runpy; runpy.run_module('sglang.launch_server', "
        "run_name='__main__')"
    )
    env = write_fake_sglang(tmp_path)

    def command_for(i, port):
        return [sys.executable, "-c", script, "--model-path", "/m", "--host", "127.0.0.1", "--port", str(port)]

    launcher = SGLangLauncher(command_for, 1, log_dir=str(tmp_path / "logs"), env=env, poll=0.05)
    launcher.start()
    child = int(child_pid.read_text())
    assert not gone(child)
    launcher.stop(grace=5)
    end = time.monotonic() + 10
    while not gone(child) and time.monotonic() < end:
        time.sleep(0.05)
    if not gone(child):
        os.kill(child, signal.SIGKILL)
        pytest.fail("the server's child process outlived stop()")


def test_keyed_launch_hands_the_key_over_off_the_command_line(tmp_path):
    """SGLang reads its key from argv only: the launcher starts it through a wrapper that appends the key inside
    the process, so `ps` (the exec'd argv) never shows it; the log, where SGLang prints its arguments, is 0600."""
    env = write_fake_sglang(tmp_path)
    launcher = SGLangLauncher(
        fake_sglang_command, 1, log_dir=str(tmp_path / "logs"), env=env, poll=0.05, ready_timeout=60, keyed=True
    )
    other = SGLangLauncher(fake_sglang_command, 1, log_dir=str(tmp_path / "logs2"), keyed=True)
    assert launcher.api_key and launcher.api_key != other.api_key and launcher.admin_api_key is None
    try:
        url = launcher.start()[0]
        pid = launcher.pids[0]
        with open(tmp_path / f"pid_{pid}") as f:
            argv = json.load(f)
        assert argv[-2:] == ["--api-key", launcher.api_key]  # what SGLang parses
        assert argv[:-2] == fake_sglang_command(0, int(url.rsplit(":", 1)[1]))[3:]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert launcher.api_key.encode() not in f.read()
        assert os.stat(tmp_path / "logs" / "engine_0.log").st_mode & 0o077 == 0
    finally:
        launcher.stop(grace=5)
