"""Engines come and go (--use-fault-tolerance; lichen.engines.clients.pool, docs/fault-tolerance.md#engines-come-and-go).

Real `lichen serve` engines on the tiny checkpoint:
- one engine dies with requests in flight: ONE warning sums it up (what, how many re-sent, how long), the
  per-request lines are at debug level;
- restarts that keep failing (scripted: the launcher's model path is made to point at nothing, so every restart
  is a real `lichen serve` that exits at start) retire the engine with one warning and the run goes on; when the
  last engine is retired too, below --min-healthy-engines, generation stops with one line (EnginesBelowFloor);
- engines added through the control file (an external address and a `launch` line) wait out of rotation until
  the next weight sync, then serve the current version; bad lines get one error each naming file:line.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import pytest
from helpers.serve_process import launch
from helpers.waits import wait_for

from lichen.engines.api.auth import SERVE_ADMIN_KEY_ENV, SERVE_KEY_ENV
from lichen.engines.clients.launcher import EngineLauncher
from lichen.engines.clients.pool import pool_metrics
from lichen.engines.clients.remote_engines import RemoteEngines
from lichen.engines.clients.router import EnginesBelowFloor
from lichen.engines.core.engine import GenRequest
from lichen.errors import RunError

SERVER_ARGS = ["--num-threads", "1"]


def requests(n: int, new_tokens: int = 8) -> list[GenRequest]:
    return [GenRequest(input_ids=[i + 1, 2, 3], max_new_tokens=new_tokens, seed=i) for i in range(n)]


def messages(caplog, text: str, level: int | None = None) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage() and (level is None or r.levelno == level)]


@pytest.mark.slow
def test_one_line_per_death_then_retired_then_below_the_floor(tiny_ckpt, tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="lichen")
    launcher = EngineLauncher(tiny_ckpt, 2, server_args=SERVER_ARGS, log_dir=str(tmp_path / "logs"))
    engines = RemoteEngines(launcher.start(), launcher=launcher, failover=True, concurrency=64, retry_delay=0.05)
    try:
        monitor = engines.start_health_monitor(
            interval=0.2, timeout=30.0, first_wait=0, pool={"min_healthy": 1, "max_failed_restarts": 2}
        )
        launcher.model = str(tmp_path / "no-such-model")  # every restart from now on exits at start

        # engine 0 dies holding many requests: one summary line
        reqs = requests(40, new_tokens=48)
        out: dict = {}
        worker = threading.Thread(target=lambda: out.setdefault("results", engines.generate(reqs)))
        worker.start()
        wait_for(lambda: engines.clients[0].in_flight >= 5, what="engine 0 to hold requests")
        os.kill(launcher.pids[0], signal.SIGKILL)
        worker.join(300)
        assert not worker.is_alive() and len(out["results"]) == 40
        resent = engines.router.reissued_from[0]
        assert resent >= 5
        summary = messages(caplog, "left rotation", logging.WARNING)
        assert len(summary) == 1, summary
        assert f"{resent} request(s) it held re-sent" in summary[0] and engines.urls[0] in summary[0]
        assert len(messages(caplog, "re-sending a request", logging.DEBUG)) == resent  # the detail: debug only
        assert not [r for r in caplog.records if "re-sending" in r.getMessage() and r.levelno > logging.DEBUG]

        # its restarts fail (a real lichen serve that cannot load the model): retired after 2, the run goes on
        wait_for(lambda: monitor.states[0] == "retired", 300, "engine 0 to be retired")
        assert monitor.pool.failed_restarts[0] == 2 and monitor.restarts == [0, 0]
        retired = messages(caplog, "retired after", logging.WARNING)
        assert len(retired) == 1 and "continues on 1 engine(s)" in retired[0], retired
        assert len(engines.generate(requests(4))) == 4
        assert pool_metrics(engines) == {
            "engines/healthy": 1.0,
            "engines/retired": 1.0,
            "engines/added": 0.0,
            "engines/restarts": 0.0,  # every restart failed
        }

        # the last engine fails the same way: below the floor of 1, generation stops with one line
        os.kill(launcher.pids[1], signal.SIGKILL)
        wait_for(lambda: monitor.states[1] == "retired", 300, "engine 1 to be retired")
        with pytest.raises(EnginesBelowFloor) as info:
            engines.generate(requests(2))
        assert isinstance(info.value, RunError) and "\n" not in str(info.value)
        assert "fewer than --min-healthy-engines 1: the run stops" in str(info.value)
        assert len(messages(caplog, "the run stops", logging.ERROR)) == 1
    finally:
        engines.close()
    assert not any(launcher.alive())


@pytest.mark.slow
def test_engines_added_mid_run_wait_for_the_next_sync(tiny_ckpt, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="lichen")
    control = tmp_path / "engines.add"
    launcher = EngineLauncher(tiny_ckpt, 1, server_args=SERVER_ARGS, log_dir=str(tmp_path / "logs"))
    engines = RemoteEngines(launcher.start(), launcher=launcher, failover=True, retry_delay=0.05)
    keys = {SERVE_KEY_ENV: launcher.api_key, SERVE_ADMIN_KEY_ENV: launcher.admin_api_key}
    external = launch(tiny_ckpt, *SERVER_ARGS, env=keys, log_path=str(tmp_path / "external.log"))
    try:
        monitor = engines.start_health_monitor(
            interval=0.2,
            timeout=30.0,
            first_wait=0,
            pool={
                "control_file": str(control),
                "add_keys": (launcher.api_key, launcher.admin_api_key),
                "required": {"/generate": "rollout", "/update_weights_from_disk": "--update-weight-transport disk"},
            },
        )
        engines.update_weights_from_disk(tiny_ckpt, "1")  # a sync happened: new engines wait for the next one
        control.write_text(f"# engines for this run\n{external.url}\nnot a url at all\n\nlaunch\n{external.url}\n")
        wait_for(lambda: len(monitor.states) == 3, 300, "two engines to be added")
        wait_for(lambda: len(messages(caplog, "engine not added")) == 2, 60, "the two bad lines to be reported")
        errors = messages(caplog, "engine not added", logging.ERROR)
        assert f"{control}:3: engine not added" in errors[0] and "not an engine address" in errors[0]
        assert f"{control}:6: engine not added" in errors[1] and "already in the pool" in errors[1]
        assert monitor.states[1:] == ["pending", "pending"] and engines.router.in_rotation() == [0]
        assert {r.weight_version for r in engines.generate(requests(6))} == {"1"}  # only the synced engine works
        assert pool_metrics(engines) == {
            "engines/healthy": 1.0,
            "engines/retired": 0.0,
            "engines/added": 2.0,
            "engines/restarts": 0.0,
        }

        engines.update_weights_from_disk(tiny_ckpt, "2")  # the next sync brings them in, at the current version
        assert engines.router.in_rotation() == [0, 1, 2] and engines.weight_versions() == ["2", "2", "2"]
        results = engines.generate(requests(12))
        assert {r.weight_version for r in results} == {"2"} and len({r.engine for r in results}) == 3
        assert pool_metrics(engines)["engines/healthy"] == 3.0
        with open(control, "a") as f:  # lines already read are not read again
            f.write("launch\n")
        wait_for(lambda: len(monitor.states) == 4, 300, "the appended line to be read")
        assert len(launcher.servers) == 3
    finally:
        engines.close()
        external.stop()
    assert not any(launcher.alive())


def test_pool_flags(tiny_ckpt, addition_data, tmp_path):
    from helpers.runs import base_args

    from lichen.config import parse_train_args
    from lichen.config.engine_config import EngineConfig
    from lichen.errors import ConfigError

    engines = ["--num-rollout", "1", "--rollout-num-engines", "2", "--update-weight-transport", "disk"]
    engines += ["--update-weight-disk-dir", str(tmp_path / "w")]

    def parse(*extra):
        return parse_train_args(base_args(tiny_ckpt, addition_data, tmp_path / "o", *engines, *extra)[1:])

    cfg = EngineConfig.from_args(parse("--use-fault-tolerance"))
    assert (cfg.min_healthy, cfg.max_failed_restarts) == (1, 3)
    assert cfg.control_file == str(tmp_path / "o" / "engines.add")
    args = parse("--use-fault-tolerance", "--min-healthy-engines", "2", "--rollout-max-failed-restarts", "5")
    assert (args.min_healthy_engines, args.rollout_max_failed_restarts) == (2, 5)
    for extra, text in [
        (["--min-healthy-engines", "1"], "--min-healthy-engines only applies with --use-fault-tolerance"),
        (["--rollout-max-failed-restarts", "2"], "--rollout-max-failed-restarts only applies with"),
        (["--use-fault-tolerance", "--min-healthy-engines", "0"], "--min-healthy-engines must be >= 1, got 0"),
        (["--use-fault-tolerance", "--rollout-max-failed-restarts", "0"], "--rollout-max-failed-restarts must be"),
        (["--use-fault-tolerance", "--min-healthy-engines", "3"], "is more than the run's 2 engine(s)"),
    ]:
        with pytest.raises(ConfigError) as info:
            parse(*extra)
        assert text in str(info.value), str(info.value)


def test_a_hostile_control_file_is_refused_without_hanging(tmp_path, caplog):
    """The control file is read from the engines' event loop: a FIFO planted there must not block it, a link must
    not make lichen read (or quote) another file, and a line being written is not read half."""
    from types import SimpleNamespace

    from lichen.engines.clients.pool import EnginePool

    control = tmp_path / "engines.add"
    engines = SimpleNamespace(clients=[], router=SimpleNamespace(in_rotation=list))
    pool = EnginePool(engines, control_file=str(control))

    def read_lines() -> list:
        out: list = []
        reader = threading.Thread(target=lambda: out.append(pool.read_new_lines()), daemon=True)
        reader.start()
        reader.join(30)
        assert not reader.is_alive(), "reading the control file hangs"
        return out[0]

    os.mkfifo(control)
    assert read_lines() == [] and read_lines() == []
    control.unlink()
    secret = tmp_path.parent / f"{tmp_path.name}-secret"
    secret.write_text("http://10.0.0.1:1\n")
    control.symlink_to(secret)
    assert read_lines() == []
    control.unlink()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and "not a regular file" in errors[0] and "outside its directory" in errors[1], errors
    assert "10.0.0.1" not in " ".join(errors)
    control.write_text("http://127.0.0.1:9\nlaunch")  # the second line has no newline yet
    assert read_lines() == [(1, "http://127.0.0.1:9")]
    with open(control, "a") as f:
        f.write("\n")
    assert read_lines() == [(2, "launch")]
