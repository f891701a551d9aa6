"""`lichen serve` off loopback: it refuses to start without --api-key, and with one it checks keys as SGLang does
(docs/architecture.md#engine-authentication): health endpoints open, 401 otherwise; an admin key guards the control
endpoints."""

import os
import subprocess
import sys

import pytest
from helpers.serve_process import call, launch

KEY, ADMIN = "s3cret-key", "admin-key"


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("serve_auth") / "serve.log")
    proc = launch(
        tiny_ckpt, "--host", "0.0.0.0", "--api-key", KEY, "--admin-api-key", ADMIN, "--num-threads", "1", log_path=log
    )  # clients reach 0.0.0.0 through 127.0.0.1
    yield proc
    proc.stop()


def bearer(key):
    return {"Authorization": f"Bearer {key}"}


GEN = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}


def test_refuses_a_public_address_without_a_key(tiny_ckpt):
    r = subprocess.run(
        [sys.executable, "-m", "lichen.cli", "serve", "--model", tiny_ckpt, "--host", "0.0.0.0", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--api-key" in r.stderr and "0.0.0.0" in r.stderr


@pytest.mark.slow
def test_data_plane_needs_the_key(server):
    for headers in (None, bearer("wrong"), {"x-api-key": "wrong"}, {"Authorization": KEY}):
        st, body = call(server.url + "/generate", GEN, headers=headers)
        assert (st, body) == (401, {"error": "Unauthorized"}), headers
    assert call(server.url + "/model_info")[0] == 401
    assert call(server.url + "/v1/models")[0] == 401
    assert call(server.url + "/generate", GEN, headers=bearer(KEY))[0] == 200
    assert call(server.url + "/generate", GEN, headers={"x-api-key": KEY})[0] == 200
    assert call(server.url + "/model_info", headers=bearer(KEY))[0] == 200


def test_health_endpoints_are_open(server):
    assert call(server.url + "/health") == (200, None)
    assert call(server.url + "/health_generate") == (200, None)


def test_control_endpoints_take_only_the_admin_key(server):
    body = {"abort_all": True}
    assert call(server.url + "/abort_request", body)[0] == 401
    assert call(server.url + "/abort_request", body, headers=bearer(KEY))[0] == 401
    assert call(server.url + "/abort_request", body, headers=bearer(ADMIN))[0] == 200
    assert call(server.url + "/flush_cache", headers=bearer(KEY))[0] == 401
    assert call(server.url + "/flush_cache", headers=bearer(ADMIN))[0] == 200
    # lichen's own: resetting the peak memory the trainer measures per phase (docs/serving.md)
    assert call(server.url + "/reset_peak_memory", {})[0] == 401
    assert call(server.url + "/reset_peak_memory", {}, headers=bearer(KEY))[0] == 401
    assert call(server.url + "/reset_peak_memory", {}, headers=bearer(ADMIN))[0] == 200
    status, info = call(server.url + "/server_info", headers=bearer(KEY))
    assert status == 200 and 0.01 < info["memory"]["peak_rss_gb"] < 64 and "peak_rss_is_lifetime" not in info["memory"]


def test_either_header_may_carry_the_key(server):
    # a client that sends a stale Bearer and the right x-api-key (or the other way round) is let in, as SGLang
    assert call(server.url + "/generate", GEN, headers={**bearer("wrong"), "x-api-key": KEY})[0] == 200
    assert call(server.url + "/generate", GEN, headers={**bearer(KEY), "x-api-key": "wrong"})[0] == 200
    assert (
        call(server.url + "/abort_request", {"abort_all": True}, headers={**bearer(KEY), "x-api-key": ADMIN})[0] == 200
    )


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


@pytest.mark.slow
def test_keys_from_a_file_or_the_environment_stay_off_the_command_line(tiny_ckpt, tmp_path):
    loose = tmp_path / "loose.key"
    loose.write_text(KEY + "\n")
    os.chmod(loose, 0o644)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "lichen.cli",
            "serve",
            "--model",
            tiny_ckpt,
            "--port",
            "0",
            "--api-key-file",
            str(loose),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "chmod 600" in r.stderr and "Traceback" not in r.stderr
    assert KEY not in r.stderr
    key_file = tmp_path / "api.key"
    key_file.write_text(KEY + "\n")
    os.chmod(key_file, 0o600)
    proc = launch(
        tiny_ckpt,
        "--host",
        "0.0.0.0",
        "--api-key-file",
        str(key_file),
        "--num-threads",
        "1",
        env={"LICHEN_ADMIN_API_KEY": ADMIN},
        log_path=str(tmp_path / "serve.log"),
    )
    try:
        assert KEY not in _cmdline(proc.proc.pid) and ADMIN not in _cmdline(proc.proc.pid)
        assert call(proc.url + "/generate", GEN)[0] == 401
        assert call(proc.url + "/generate", GEN, headers=bearer(KEY))[0] == 200
        assert call(proc.url + "/flush_cache", headers=bearer(KEY))[0] == 401
        assert call(proc.url + "/flush_cache", headers=bearer(ADMIN))[0] == 200
    finally:
        proc.stop()
    assert KEY not in (tmp_path / "serve.log").read_text()


@pytest.mark.slow
def test_launched_engines_get_a_fresh_key_per_run(tiny_ckpt, tmp_path):
    from lichen.engines.clients.launcher import EngineLauncher
    from lichen.engines.clients.remote_engines import RemoteEngines
    from lichen.engines.core.engine import GenRequest

    launcher = EngineLauncher(tiny_ckpt, 1, server_args=["--num-threads", "1"], log_dir=str(tmp_path))
    other = EngineLauncher(tiny_ckpt, 1)
    assert launcher.api_key and launcher.admin_api_key and launcher.api_key != other.api_key
    engines = RemoteEngines(launcher.start(), launcher=launcher, concurrency=2)
    try:
        url, pid = launcher.urls[0], launcher.pids[0]
        assert call(url + "/generate", GEN)[0] == 401  # any local user without the key
        assert (
            call(url + "/pull_weights", {"local_checkpoint_dir": "/x", "source_dir": "/y", "target_version": 0})[0]
            == 401
        )
        assert call(url + "/flush_cache", headers=bearer(launcher.api_key))[0] == 401  # user key: no admin paths
        for key in (launcher.api_key, launcher.admin_api_key):
            assert key not in _cmdline(pid)
        out = engines.generate([GenRequest([5, 6], 2, seed=3, ignore_eos=True)])  # the run's client sends the keys
        assert len(out[0].output_ids) == 2
        engines.flush_cache()
    finally:
        engines.close()
    for name in os.listdir(tmp_path):
        assert launcher.api_key not in (tmp_path / name).read_text(errors="replace")


def test_external_engine_keys_come_from_a_file_or_the_environment(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from lichen.engines.clients.launch_args import external_keys

    key_file = tmp_path / "engine.key"
    key_file.write_text(KEY)
    os.chmod(key_file, 0o600)
    monkeypatch.setenv("LICHEN_ENGINE_API_KEY", "from-env")
    monkeypatch.setenv("LICHEN_ENGINE_ADMIN_API_KEY", ADMIN)
    cfg = SimpleNamespace(api_key_file=str(key_file), admin_api_key_file=None)
    assert external_keys(cfg) == (KEY, ADMIN)  # the file wins over the environment
    cfg.api_key_file = None
    assert external_keys(cfg) == ("from-env", ADMIN)
    # the old flag put the key on the command line: refused with one line saying where the key goes now
    r = subprocess.run(
        [sys.executable, "-m", "lichen.cli", "train", "--rollout-external-engine-api-key", KEY],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "was removed" in r.stderr and "--rollout-external-engine-api-key-file" in r.stderr
    assert "Traceback" not in r.stderr
