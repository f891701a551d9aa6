"""`launch` lines of the engine control file for SGLang / vLLM launched engines (SGLangLauncher.add, which
VLLMLauncher inherits; docs/fault-tolerance.md#engines-come-and-go), against the stand-in `sglang.launch_server`
module of tests/helpers/fake_sglang.py (no GPU, no SGLang needed):

- `add()` starts engine K with the same command builder and returns its URL once ready; a start that fails leaves
  nothing running (the process group is gone, the engine is not in the launcher's list) and raises the launcher's
  error with the log tail; a stopped launcher refuses;
- an added engine past the GPUs lichen was given is refused with one line naming the GPUs it would need; a vLLM
  engine added to a one-engine run gets its own CUDA_VISIBLE_DEVICES slice, not the first engine's by inheritance;
- through the pool: a `launch` line on an SGLang run adds an engine that is pending until the next weight sync.
"""

from __future__ import annotations

import json
import logging
import sys

import pytest
from helpers.fake_sglang import write_fake_sglang
from helpers.serve_process import call
from helpers.waits import gone, wait_for

from lichen.engines.clients.pool import EnginePool, pool_metrics
from lichen.engines.clients.remote_engines import RemoteEngines
from lichen.engines.clients.sglang_launcher import SGLangLauncher, SGLangLaunchError


def command_for(i: int, port: int) -> list[str]:
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", f"/m{i}", "--host", "127.0.0.1"] + [
        "--port",
        str(port),
    ]


def test_add_starts_the_next_engine_with_the_same_builder(tmp_path):
    env = write_fake_sglang(tmp_path)
    launcher = SGLangLauncher(command_for, 1, log_dir=str(tmp_path / "logs"), env=env, poll=0.05, ready_timeout=60)
    try:
        first = launcher.start()[0]
        url = launcher.add()
        assert url != first and launcher.urls == [first, url] and launcher.num_engines == 2
        assert call(url + "/model_info")[1]["model_path"] == "/m1"  # engine index 1 of the builder
        with open(tmp_path / f"pid_{launcher.pids[1]}") as f:
            assert json.load(f) == command_for(1, int(url.rsplit(":", 1)[1]))[3:]
        assert (tmp_path / "logs" / "engine_1.log").exists()
        launcher.restart(1)  # the added engine is restarted like the others
        assert launcher.alive() == [True, True]
    finally:
        launcher.stop(grace=5)
    assert launcher.alive() == [False, False]
    with pytest.raises(SGLangLaunchError, match="cannot add an engine: the sglang launcher is stopped"):
        launcher.add()
    assert len(launcher.servers) == 2


@pytest.mark.slow
def test_a_failed_add_leaves_nothing_running(tmp_path):
    env = write_fake_sglang(tmp_path)
    pid_file = tmp_path / "hung_pid"
    mode = {"added": "exits"}

    def builder(i: int, port: int) -> list[str]:
        if i == 0:
            return command_for(i, port)
        if mode["added"] == "exits":
            return [sys.executable, "-c", "import sys; print('boom at start'); sys.exit(3)"]
        # never answers: the ready timeout ends it
        script = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(300)"
        return [sys.executable, "-c", script]

    launcher = SGLangLauncher(builder, 1, log_dir=str(tmp_path / "logs"), env=env, poll=0.05, ready_timeout=60)
    try:
        launcher.start()
        with pytest.raises(SGLangLaunchError, match="exited with code 3") as info:
            launcher.add()
        assert "boom at start" in str(info.value)  # the log tail
        assert len(launcher.servers) == 1 and launcher.num_engines == 1

        mode["added"] = "hangs"
        launcher.ready_timeout = 3.0
        with pytest.raises(SGLangLaunchError, match="did not answer /health_generate within 3 s"):
            launcher.add()
        assert len(launcher.servers) == 1 and launcher.alive() == [True]
        assert gone(int(pid_file.read_text()))  # its process group was killed
        mode["added"] = "exits"
    finally:
        launcher.stop(grace=5)


def test_an_added_engine_past_the_given_gpus_is_refused(tmp_path):
    env = write_fake_sglang(tmp_path)
    launcher = SGLangLauncher(
        command_for, 1, log_dir=str(tmp_path / "logs"), env=env, poll=0.05, ready_timeout=60, gpus=["4", "5", "6"]
    )
    launcher.gpus_per_engine = 2  # engine 0 holds #0, #1; engine 1 would need #2, #3 of 3
    try:
        launcher.start()
        with pytest.raises(SGLangLaunchError) as info:
            launcher.add()
        msg = str(info.value)
        assert "\n" not in msg and msg.startswith("cannot add sglang engine 1: it would need GPU(s) #2, #3"), msg
        assert "lichen was given 3 (4,5,6) and engines 0..0 hold them: none are free" in msg, msg
        assert len(launcher.servers) == 1  # nothing was started
        launcher.gpus_per_engine = 1  # one GPU each: #1 is free
        assert launcher.add() and len(launcher.servers) == 2
    finally:
        launcher.stop(grace=5)


def test_a_vllm_engine_added_to_a_one_engine_run_gets_its_own_gpus(addition_data, tmp_path, monkeypatch):
    from helpers.runs import base_args
    from helpers.vllm import vllm_tiny_model

    from lichen.config import parse_train_args
    from lichen.config.engine_config import EngineConfig
    from lichen.engines.clients.vllm_launcher import VLLMLauncher

    python = tmp_path / "py"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o700)
    ckpt = vllm_tiny_model(str(tmp_path / "model"))  # a head size vLLM's CPU attention takes
    argv = base_args(ckpt, addition_data, tmp_path / "o", "--num-rollout", "1", "--rollout-engine-backend")
    argv += ["vllm", "--rollout-num-engines", "1", "--vllm-python", str(python)]
    cfg = EngineConfig.from_args(parse_train_args(argv[1:]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    monkeypatch.setattr("lichen.engines.clients.vllm_launcher.given_gpus", lambda: ["4", "5"])
    launcher = VLLMLauncher.from_config(cfg)
    assert launcher.gpus == ["4", "5"] and launcher.gpus_per_engine == 1
    assert not launcher.command_for(0, 1)[1].startswith("CUDA_VISIBLE_DEVICES")  # one engine: the run's GPUs
    assert launcher.command_for(1, 2)[1] == "CUDA_VISIBLE_DEVICES=5"  # added: the next one, not engine 0's
    launcher.servers = [object(), object()]  # as if engines 0 and 1 ran: engine 2 has no GPU left
    try:
        with pytest.raises(SGLangLaunchError, match=r"cannot add vllm engine 2: it would need GPU\(s\) #2 .* none"):
            launcher.add()
        assert len(launcher.servers) == 2
    finally:
        launcher.servers = []  # nothing to stop at exit


def test_a_launch_line_adds_an_sglang_engine_pending_until_the_next_sync(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="lichen")
    env = write_fake_sglang(tmp_path)
    control = tmp_path / "engines.add"
    weights = tmp_path / "weights"
    weights.mkdir()
    launcher = SGLangLauncher(command_for, 1, log_dir=str(tmp_path / "logs"), env=env, poll=0.05, ready_timeout=60)
    engines = RemoteEngines(launcher.start(), launcher=launcher, failover=True, retry_delay=0.05)
    try:
        monitor = engines.start_health_monitor(
            interval=0.2, timeout=30.0, first_wait=0, pool={"control_file": str(control)}
        )
        assert isinstance(monitor.pool, EnginePool)
        engines.update_weights_from_disk(str(weights), "1")  # a sync happened: the new engine waits for the next
        control.write_text("launch\n")
        wait_for(lambda: len(monitor.states) == 2, 120, "the launched engine to be added")
        assert len(launcher.servers) == 2 and engines.urls == launcher.urls
        assert monitor.states[1] == "pending" and engines.router.in_rotation() == [0]
        assert pool_metrics(engines)["engines/added"] == 1.0 and pool_metrics(engines)["engines/healthy"] == 1.0
        assert not [r for r in caplog.records if "engine not added" in r.getMessage()]

        engines.update_weights_from_disk(str(weights), "2")  # the next sync brings it in, at the current version
        assert engines.router.in_rotation() == [0, 1] and engines.weight_versions() == ["2", "2"]
        assert pool_metrics(engines)["engines/healthy"] == 2.0
    finally:
        engines.close()
    assert launcher.alive() == [False, False]  # the added engine is stopped with the others


def test_a_launch_line_on_external_engines_is_refused_with_one_line():
    import asyncio
    from types import SimpleNamespace

    pool = EnginePool(SimpleNamespace(clients=[], launcher=None))
    with pytest.raises(ValueError) as info:
        asyncio.run(pool.add_line("launch"))
    msg = str(info.value)
    assert "\n" not in msg and "external (--rollout-external-engine-addrs)" in msg and "give an address" in msg
