"""`ray job submit -- lichen train --runtime ray ...` against a Ray head started here with `ray start --head` and
its dashboard's job server (needs `ray[default]`), and a run without an address next to such a head.

The head runs in its own temp directory (RAY_TMPDIR, short: Ray's socket paths must stay under 108 characters),
so no other Ray user on this host finds it as "the current cluster", and in its own process group, which the
fixture ends (never `ray stop`, which stops every Ray on the host). Ray 2.60 turns on token authentication by
default; the test's head listens on 127.0.0.1 and runs with RAY_AUTH_MODE=disabled, as do the clients.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install 'lichen[ray]')")
pytest.importorskip("aiohttp_cors", reason="Ray's job server needs ray[default] (pip install 'lichen[test]')")

from helpers.dist_ranks import free_port  # noqa: E402
from helpers.runs import base_args, read_metrics  # noqa: E402

pytestmark = pytest.mark.e2e  # see the marker in pyproject.toml: make test leaves it to make test-e2e

BIN = os.path.dirname(sys.executable)
TESTS = os.path.dirname(os.path.abspath(__file__))
HEAD_START_S = 300  # a generous deadline: the head's start-up shares 2 busy cores


@pytest.fixture(scope="module")
def ray_head():
    tmp = tempfile.mkdtemp(prefix="lrj", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("LICHEN_TEST_")}
    env.update(RAY_TMPDIR=tmp, RAY_AUTH_MODE="disabled", PYTHONPATH=TESTS)  # the runs' reward plug-in is here
    dash = free_port()
    log = open(os.path.join(tmp, "head.log"), "w")
    head = subprocess.Popen(
        [
            os.path.join(BIN, "ray"),
            "start",
            "--head",
            "--block",
            "--port",
            str(free_port()),
            "--dashboard-host",
            "127.0.0.1",
            "--dashboard-port",
            str(dash),
            "--include-dashboard",
            "true",
            "--num-cpus",
            "4",
            "--num-gpus",
            "3",
            "--disable-usage-stats",
            # Every port of its own: another Ray instance on this host (the test process's shared one,
            # tests/helpers/ray_local.py, or the other pytest worker's) holds Ray's default agent ports, and a head
            # whose job agent cannot bind answers every submission "No available agent to submit job".
            "--dashboard-agent-listen-port",
            str(free_port()),
            "--dashboard-agent-grpc-port",
            str(free_port()),
            "--runtime-env-agent-port",
            str(free_port()),
            "--metrics-export-port",
            str(free_port()),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + HEAD_START_S
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/version", timeout=5).read()
                break
            except OSError:
                assert head.poll() is None and time.monotonic() < deadline, open(log.name).read()[-3000:]
                time.sleep(1)
        yield url, env
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # the head and every process it started share its group
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(head.pid, signal.SIGKILL)  # `ray start --block` leaves some of them to a second signal
        except ProcessLookupError:
            pass
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _lichen_argv(tiny_ckpt: str, data: str, out, *extra: str) -> list[str]:
    return [
        os.path.join(BIN, "lichen"),
        *base_args(tiny_ckpt, data, out, "--device", "cpu", "--num-threads", "1", "--runtime", "ray", *extra),
    ]


@pytest.mark.slow
def test_ray_job_submit_runs_lichen_train_on_the_head(ray_head, tiny_ckpt, addition_data, tmp_path):
    url, env = ray_head
    job = "lichen-job-test"
    argv = _lichen_argv(
        tiny_ckpt,
        addition_data,
        tmp_path / "out",
        "--num-rollout",
        "2",
        "--actor-num-gpus-per-node",
        "2",
        "--rollout-num-gpus",
        "1",
    )
    # The head answers before its job agent is up on a loaded machine ("No available agent to submit job, please
    # try again later"): Ray says to retry, and nothing was submitted, so the test does (a bound, not a wait).
    deadline = time.monotonic() + 120
    while True:
        submit = subprocess.run(
            [os.path.join(BIN, "ray"), "job", "submit", "--address", url, "--submission-id", job, "--", *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if "No available agent to submit job" not in submit.stdout + submit.stderr or time.monotonic() > deadline:
            break
        time.sleep(2)
    status = subprocess.run(
        [os.path.join(BIN, "ray"), "job", "status", "--address", url, job],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    logs = submit.stdout + submit.stderr
    assert f"Job '{job}' succeeded" in status.stdout + status.stderr, logs[-4000:]
    assert "Connecting to existing Ray cluster" in logs  # the job's driver joined the head (RAY_ADDRESS)
    assert "trainer: 2 rank(s)" in logs and "started 1 lichen serve engine(s) on Ray" in logs
    steps = [m for m in read_metrics(str(tmp_path / "out")) if "train/loss" in m]
    assert [m["sync/weight_version"] for m in steps] == [1, 2]


@pytest.mark.slow
def test_without_an_address_a_run_starts_its_own_ray_next_to_a_ray_start_head(
    ray_head, tiny_ckpt, addition_data, tmp_path
):
    """ray.init() without an address joins the cluster `ray start` recorded on this host, and refuses the options
    of an instance lichen sizes for the run: lichen asks for a local instance."""
    _, env = ray_head
    run = subprocess.run(
        _lichen_argv(
            tiny_ckpt,
            addition_data,
            tmp_path / "out",
            "--num-rollout",
            "1",
            "--actor-num-gpus-per-node",
            "1",
            "--rollout-num-gpus",
            "1",
        ),
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert "Started a local Ray instance" in run.stderr
    assert [m["sync/weight_version"] for m in read_metrics(str(tmp_path / "out")) if "train/loss" in m] == [1]
