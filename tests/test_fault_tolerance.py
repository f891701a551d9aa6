"""Fault tolerance (--use-fault-tolerance): health monitor, re-sent requests, restarts, re-joining at the next sync.

- Stand-in engines (tests/helpers/fake_sglang.py FAKE_LAUNCH_SERVER, started by the SGLang launcher; no torch,
  so they start in a blink): a hung engine (SIGSTOP) holding requests, a pause held far longer than the health
  timeout, and the same pause done behind lichen's back (which must count as a hang).
- Real `lichen serve` engines in a training run: SIGKILL one while it has requests in flight; the step completes
  with every group whole, the samples are those of the in-process engine with the same seeds, and the engine is
  back, at the current weight version, for the next step.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from helpers.engine_kill import kill_when_busy
from helpers.fake_sglang import fake_sglang_command, write_fake_sglang
from helpers.runs import base_args, read_dump, run
from helpers.serve_process import call

from lichen.config import parse_train_args
from lichen.config.engine_config import required_endpoints
from lichen.engines.clients.remote_engines import RemoteEngines
from lichen.engines.clients.sglang_launcher import SGLangLauncher
from lichen.engines.core.engine import Engine, GenRequest
from lichen.engines.core.sampler import derive_seed
from lichen.errors import ConfigError
from lichen.rollout.generate import generate_rollout

TIMEOUT = 2.0  # health-check timeout for the stand-in engines: generous, so a loaded machine is no hang


def fake_tokens(seed: int, ids: list[int], n: int) -> list[int]:
    """What FAKE_LAUNCH_SERVER generates: a pure function of the request, so a re-sent request is recognisable."""
    return [(seed * 31 + sum(ids) + 7 * k) % 50 + 5 for k in range(n)]


def wait_for(cond, timeout: float = 30.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def fake_pair(tmp_path):
    env = {**write_fake_sglang(tmp_path), "FAKE_SGLANG_DELAY": "0.3"}

    launcher = SGLangLauncher(
        fake_sglang_command, 2, log_dir=str(tmp_path / "logs"), env=env, poll=0.05, ready_timeout=60
    )
    engines = RemoteEngines(launcher.start(), launcher=launcher, failover=True, concurrency=2, retry_delay=0.1)
    yield engines
    engines.close()
    assert launcher.alive() == [False, False]


def requests(n: int) -> list[GenRequest]:
    return [GenRequest(input_ids=[i + 1, 2, 3], max_new_tokens=4, seed=derive_seed(3, i)) for i in range(n)]


@pytest.mark.slow
def test_hung_engine_requests_move_engine_restarts_and_rejoins_at_next_sync(fake_pair, tmp_path):
    engines = fake_pair
    (tmp_path / "v1").mkdir()
    (tmp_path / "v2").mkdir()
    engines.update_weights_from_disk(str(tmp_path / "v1"), "1")  # a sync happened: re-joining waits for the next
    monitor = engines.start_health_monitor(interval=0.1, timeout=TIMEOUT, first_wait=0)
    reqs = requests(12)
    out: dict = {}
    worker = threading.Thread(target=lambda: out.setdefault("results", engines.generate(reqs)))
    worker.start()
    wait_for(lambda: engines.clients[0].in_flight > 0, what="engine 0 to hold a request")
    hung = engines.launcher.pids[0]
    os.kill(hung, signal.SIGSTOP)  # alive, accepting connections, never answering
    worker.join(60)
    assert not worker.is_alive()
    results = out["results"]
    assert [r.output_ids for r in results] == [fake_tokens(r.seed, r.input_ids, 4) for r in reqs]  # same seeds
    assert {r.weight_version for r in results} == {"1"}
    assert engines.router.reissued_from[0] >= 1 and engines.router.reissued_from[1] == 0

    wait_for(lambda: monitor.states[0] == "pending", what="engine 0 to be restarted")
    assert monitor.restarts == [1, 0] and engines.launcher.pids[0] != hung
    wait_for(
        lambda: (
            not os.path.exists(f"/proc/{hung}") or open(f"/proc/{hung}/stat").read().split(")")[-1].split()[0] == "Z"
        ),
        what="the hung process to be killed",
    )
    assert engines.router.in_rotation() == [1]  # restarted, but not at the current weights: out until the sync
    assert engines.weight_versions() == ["1"]
    engines.update_weights_from_disk(str(tmp_path / "v2"), "2")
    assert engines.router.in_rotation() == [0, 1] and engines.weight_versions() == ["2", "2"]
    assert monitor.states == ["active", "active"]
    assert [r.weight_version for r in engines.generate(requests(4))] == ["2"] * 4


@pytest.mark.slow
def test_pause_longer_than_the_timeout_is_no_failure_but_a_hidden_pause_is(fake_pair):
    engines = fake_pair
    monitor = engines.start_health_monitor(interval=0.1, timeout=TIMEOUT, first_wait=0)
    wait_for(lambda: min(monitor.probes) >= 2, what="health checks")
    engines.pause_generation()  # as a long weight sync does
    probes = list(monitor.probes)
    time.sleep(2 * TIMEOUT)  # paused for twice the timeout
    assert monitor.restarts == [0, 0] and engines.router.in_rotation() == [0, 1]
    assert monitor.probes == probes  # suspended, not merely forgiven
    engines.continue_generation()
    wait_for(lambda: min(p - q for p, q in zip(monitor.probes, probes)) >= 2, what="health checks to resume")
    assert monitor.restarts == [0, 0]
    engines.offload()
    assert monitor.suspended  # offloaded engines are not probed either
    engines.onload()
    assert not monitor.suspended

    # The same pause, sent to engine 1 behind lichen's back, is a hang: it is restarted, and as no weight sync
    # has happened yet (it serves the launch checkpoint, which is current) it re-joins at once.
    assert call(engines.urls[1] + "/pause_generation", {})[0] == 200
    wait_for(
        lambda: monitor.restarts[1] == 1 and engines.router.in_rotation() == [0, 1],
        what="engine 1 to be restarted and re-join",
    )
    assert monitor.restarts == [0, 1] and engines.weight_versions() == ["default", "default"]
    assert len(engines.generate(requests(4))) == 4


def test_an_external_engine_is_probed_until_it_answers_again(tmp_path):
    """lichen cannot restart an engine it did not launch: it leaves rotation and re-joins once it answers."""
    env = write_fake_sglang(tmp_path)

    with SGLangLauncher(fake_sglang_command, 2, log_dir=str(tmp_path / "logs"), env=env, poll=0.05) as launcher:
        with RemoteEngines(launcher.urls, failover=True, retry_delay=0.1) as engines:  # "external": no launcher
            monitor = engines.start_health_monitor(interval=0.1, timeout=TIMEOUT, first_wait=0)
            os.kill(launcher.pids[0], signal.SIGSTOP)
            try:
                wait_for(lambda: monitor.states[0] == "down", what="engine 0 to be found hung")
                assert engines.router.in_rotation() == [1] and len(engines.generate(requests(3))) == 3
            finally:
                os.kill(launcher.pids[0], signal.SIGCONT)
            wait_for(lambda: engines.router.in_rotation() == [0, 1], what="engine 0 to re-join")
            assert monitor.restarts == [0, 0] and launcher.alive() == [True, True]


def test_fault_tolerance_flags(tiny_ckpt, addition_data, tmp_path):
    def parse(*extra):
        return parse_train_args(base_args(tiny_ckpt, addition_data, tmp_path / "o", "--num-rollout", "1", *extra)[1:])

    disk = [
        "--rollout-num-engines",
        "2",
        "--update-weight-transport",
        "disk",
        "--update-weight-disk-dir",
        str(tmp_path / "w"),
    ]
    args = parse(*disk, "--use-fault-tolerance", "--rollout-health-check-timeout", "2")
    assert (
        args.rollout_health_check_interval,
        args.rollout_health_check_timeout,
        args.rollout_health_check_first_wait,
    ) == (10.0, 2.0, 300.0)
    assert required_endpoints(args)["/health_generate"] == "--use-fault-tolerance"
    assert "/health_generate" not in required_endpoints(parse(*disk))
    for extra, text in [
        (["--use-fault-tolerance"], "use it with --rollout-num-engines K or --rollout-external-engine-addrs"),
        (
            [*disk, "--rollout-health-check-interval", "1"],
            "--rollout-health-check-interval only applies with --use-fault-tolerance",
        ),
        ([*disk, "--use-fault-tolerance", "--rollout-health-check-timeout", "0"], "--rollout-health-check-timeout"),
        (
            [*disk, "--use-fault-tolerance", "--rollout-health-check-first-wait", "-1"],
            "--rollout-health-check-first-wait",
        ),
    ]:
        with pytest.raises(ConfigError) as info:
            parse(*extra)
        assert text in str(info.value), str(info.value)


# ---- real servers, a real run ------------------------------------------------------------------------------------
SEEN: dict = {}


def killing_rollout(args, rollout_id, data_source, evaluation=False):
    """Step 0: SIGKILL engine 0 while it has a request in flight. Step 1: record the engines' state."""
    from lichen.rollout.context import current

    engines = current().engine
    if rollout_id == 0:
        killer = kill_when_busy(engines, 0, SEEN)
        groups = generate_rollout(args, rollout_id, data_source)
        killer.join()
        SEEN["reissued_from"] = list(engines.router.reissued_from)
    else:
        SEEN["step1"] = {
            "in_rotation": engines.router.in_rotation(),
            "versions": engines.weight_versions(),
            "pids": list(engines.launcher.pids),
            "restarts": list(engines.monitor.restarts),
        }
        groups = generate_rollout(args, rollout_id, data_source)
    return groups


@pytest.mark.slow
def test_sigkill_an_engine_mid_step(tiny_ckpt, addition_data, tmp_path, launched):
    SEEN.clear()
    dump = str(tmp_path / "r_{rollout_id}.pt")
    run(
        base_args(
            tiny_ckpt,
            addition_data,
            tmp_path / "o",
            "--num-rollout",
            "2",
            "--num-threads",
            "1",
            "--rollout-num-engines",
            "2",
            "--update-weight-transport",
            "disk",
            "--update-weight-disk-dir",
            str(tmp_path / "w"),
            "--sglang-server-concurrency",
            "1",
            "--use-fault-tolerance",
            "--rollout-health-check-interval",
            "0.5",
            "--rollout-health-check-timeout",
            "5",
            "--rollout-health-check-first-wait",
            "0",
            "--rollout-function-path",
            "test_fault_tolerance.killing_rollout",
            "--save-debug-rollout-data",
            dump,
        )
    )
    assert SEEN["in_flight_at_kill"] >= 1 and SEEN["reissued_from"][0] >= 1  # engine 0's requests were re-sent

    steps = [read_dump(dump.format(rollout_id=k))["samples"] for k in range(2)]
    for groups in steps:  # every group whole, no index twice
        assert [len(g) for g in groups] == [4, 4, 4, 4]
        assert sorted(s["index"] for g in groups for s in g) == list(range(16))
        assert all(s["group_index"] == k for k, g in enumerate(groups) for s in g)
    # step 0's samples are the in-process engine's for the same per-sample seeds, re-sent ones included
    samples = [s for g in steps[0] for s in g]
    reqs = [
        GenRequest(
            input_ids=s["tokens"][: len(s["tokens"]) - s["response_length"]],
            max_new_tokens=8,
            seed=derive_seed(1234, 0, s["group_index"], s["index"] % 4),
        )
        for s in samples
    ]
    local = Engine.from_pretrained(tiny_ckpt).generate(reqs)
    for s, res in zip(samples, local):
        assert s["tokens"][len(s["tokens"]) - s["response_length"] :] == res.output_ids
        assert max((abs(a - b) for a, b in zip(s["rollout_log_probs"], res.output_logprobs)), default=0.0) <= 1e-5
    assert {tuple(s["weight_versions"]) for g in steps[0] for s in g} == {("0",)}

    # next step: the engine is back (a new process), in rotation, at the current version
    step1 = SEEN["step1"]
    assert step1["in_rotation"] == [0, 1] and step1["versions"] == ["1", "1"] and step1["restarts"] == [1, 0]
    assert step1["pids"][0] != SEEN["killed_pid"]
    assert {tuple(s["weight_versions"]) for g in steps[1] for s in g} == {("1",)}
    assert len(launched) == 1 and not any(launched[0].alive())  # the restarted one was stopped at exit too


def test_an_engine_killed_before_the_first_sync_leaves_rotation_and_the_sync_reads_the_others(fake_pair):
    """Seen in a fresh-clone CI (test_driver_death's engine SIGKILL, under load): the first sync asked every engine
    for /server_info before the health monitor had noticed the dead one; failover took it out of rotation but
    handed back None for it, and the sync crashed on it with a traceback (AttributeError in engine_dtype)."""
    from lichen.sync.verify import engine_dtype

    engines = fake_pair
    os.kill(engines.launcher.pids[0], signal.SIGKILL)
    engines.launcher.servers[0].proc.wait(30)
    infos = engines.server_infos()
    assert len(infos) == 1 and all(isinstance(i, dict) for i in infos)
    assert engines.router.in_rotation() == [1]
    engine_dtype(infos)  # what the sync reads first: no None among them
