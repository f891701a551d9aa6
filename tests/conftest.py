"""Shared fixtures: a tiny checkpoint and an addition data set (built once per session), and launched engines."""

import json
import os
import random

import pytest

_SESSION_TMP = "LICHEN_TEST_SESSION_TMP"


def pytest_configure(config):
    # The suite runs two pytest workers on two cores: one torch thread each (also in the servers and runs the tests
    # start, which inherit OMP_NUM_THREADS) avoids oversubscription, which slows tiny models down many times.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    _use_session_tmp(config)


def _use_session_tmp(config) -> None:
    """Everything the suite writes to the temp directory goes to one directory of its own, removed when the run
    passes (kept, and named, when it fails). The servers, Ray clusters, vLLM engines and runs that the tests start
    make scratch files there (sockets, logs, compile caches, multiprocessing dirs); a process a test kills cannot
    remove its own, so they were left in /tmp by the hundred. The xdist workers and every process they start
    inherit TMPDIR. The name stays short: Unix socket paths under it must fit in 107 bytes."""
    import tempfile

    if hasattr(config, "workerinput") or os.environ.get(_SESSION_TMP):
        return  # an xdist worker, or a pytest run inside the suite: the controller's directory is already set
    path = tempfile.mkdtemp(prefix="lichen-t-")
    os.chmod(path, 0o711)  # the sandbox tests' unprivileged user must reach the package copies made inside
    os.environ["TMPDIR"] = os.environ[_SESSION_TMP] = path
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    config._lichen_session_tmp = path


def pytest_sessionfinish(session, exitstatus):
    session.config._lichen_exitstatus = exitstatus


def pytest_unconfigure(config):
    import shutil

    path = getattr(config, "_lichen_session_tmp", None)
    if path is None:
        return
    if getattr(config, "_lichen_exitstatus", 1) == 0:
        shutil.rmtree(path, ignore_errors=True)
    else:
        print(f"\nthe test processes' temp files are kept in {path}")


def pytest_collection_modifyitems(config, items):
    # The modules holding a slow test go first (in their own order): under `-n 2` the long Ray, vLLM and multi-rank
    # tests then start early and the run ends on short tests, rather than one worker finishing a 100 s test alone.
    # Whole modules move, so a module-scoped fixture (a launched engine) is still set up once per worker.
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow)


def pytest_report_header(config):
    import torch

    # Float results differ in the last bits between kernel families; the header says which one this run used.
    return f"torch {torch.__version__}, CPU kernels: {torch.backends.cpu.get_cpu_capability()}"


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> str:
    from lichen.models.tiny import make_tiny_model

    out = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_model(
        str(out), arch="llama", hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, seed=0, init_std=0.1
    )
    return str(out)


def write_addition(path, n: int, seed: int = 0, hi: int = 20) -> str:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randint(0, hi), rng.randint(0, hi)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "label": str(a + b)}) + "\n")
    return str(path)


@pytest.fixture(scope="session")
def addition_data(tmp_path_factory) -> str:
    return write_addition(tmp_path_factory.mktemp("data") / "add.jsonl", 64)


@pytest.fixture(scope="module")
def pair(tiny_ckpt, tmp_path_factory):
    """Two `lichen serve` engines on the tiny checkpoint behind one RemoteEngines, shared by a test module."""
    from lichen.engines.clients.launcher import EngineLauncher
    from lichen.engines.clients.remote_engines import RemoteEngines

    tmp = str(tmp_path_factory.getbasetemp())  # the tests' weight dirs and local copies are all below it
    launcher = EngineLauncher(
        tiny_ckpt,
        2,
        server_args=["--num-threads", "1", "--weight-dir", tmp, "--local-checkpoint-dir", tmp],
        log_dir=str(tmp_path_factory.mktemp("logs")),
    )
    engines = RemoteEngines(launcher.start(), launcher=launcher, concurrency=4)
    yield engines
    engines.close()
    assert not any(launcher.alive())


@pytest.fixture
def launched(monkeypatch) -> list:
    """Every EngineLauncher a test starts (for checking that runs stop what they launched)."""
    from lichen.engines.clients.launcher import EngineLauncher

    seen: list = []
    start = EngineLauncher.start

    def recording_start(self):
        seen.append(self)
        return start(self)

    monkeypatch.setattr(EngineLauncher, "start", recording_start)
    return seen
