"""Dynamic sampling over engine servers aborts the surplus requests of a round once enough groups are kept, and
keeps exactly the groups (and samples) that generating everything would keep. Stand-in engines from
tests/test_sglang_launcher.py (deterministic tokens per request, counters of the calls they received)."""

from __future__ import annotations

import concurrent.futures

import pytest
from helpers.fake_sglang import fake_sglang_command, write_fake_sglang
from helpers.rollout import dicts_without_engine, rollout_worker
from helpers.runs import base_args
from helpers.serve_process import call
from helpers.waits import wait_for

from lichen.config import parse_train_args
from lichen.engines.clients.remote_engines import RemoteEngines
from lichen.engines.clients.sglang_launcher import SGLangLauncher
from lichen.rollout import generate as generate_module


def odd_prompts(args, group) -> bool:
    return group[0].group_index % 2 == 1  # round positions 1, 3, 5, 7 pass


@pytest.fixture
def engines(tmp_path):
    env = write_fake_sglang(tmp_path)

    launcher = SGLangLauncher(fake_sglang_command, 2, log_dir=str(tmp_path / "logs"), env=env, poll=0.05)
    with RemoteEngines(launcher.start(), launcher=launcher, concurrency=1) as eng:
        yield eng


def counts(engines) -> list[dict]:
    return [call(url + "/server_info")[1] for url in engines.urls]


def one_step(tiny_ckpt, addition_data, tmp_path, engines):
    argv = base_args(
        tiny_ckpt,
        addition_data,
        tmp_path / "o",
        "--num-rollout",
        "1",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--over-sampling-batch-size",
        "8",
        "--dynamic-sampling-filter-path",
        "test_abort_surplus.odd_prompts",
        "--debug-rollout-only",
        "--rollout-external-engine-addrs",
        *[u.split("//")[1] for u in engines.urls],
    )
    args = parse_train_args(argv[1:])
    return rollout_worker(args, engine=engines).generate(0)


def test_surplus_requests_are_aborted_and_the_kept_groups_are_unchanged(
    tiny_ckpt, addition_data, tmp_path, engines, monkeypatch
):
    # Each engine takes one request at a time, in order: the first 4 on each (round positions 0..3, one sample of
    # each on either engine) are answered, every later one is held until lichen aborts, so the cut comes before the
    # round is generated however slowly this process decides its groups. The engines are frozen until all 16
    # requests are routed: with no answer in between, the router's least-outstanding rule alternates them (request
    # k to engine k % 2). Without the pause an answer arriving mid-routing under load could send a 5th request of
    # positions 0..3 to one engine, which then held a request the kept groups need until the hold's 120 s bound.
    for url in engines.urls:
        assert call(url + "/test_hold", {"after": 4})[0] == 200
        assert call(url + "/test_freeze", {"on": True})[0] == 200
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        step = pool.submit(one_step, tiny_ckpt, addition_data, tmp_path, engines)
        wait_for(lambda: sum(engines.router.routed) == 16 or step.done(), timeout=60, what="16 requests routed")
        for url in engines.urls:
            assert call(url + "/test_freeze", {"on": False})[0] == 200
        groups, extra = step.result(timeout=120)
    assert engines.router.routed == [8, 8]
    sent = sum(c["generate_requests"] for c in counts(engines))
    assert [c["aborts"] for c in counts(engines)] == [1, 1]
    # kept: round positions 1 and 3, decided in order; positions 4..7 were cut: of their 8 requests only the one held
    # on each engine was sent, the ones queued behind the one-request-per-engine cap never were
    assert extra["rollout/dynamic_sampling_aborted_groups"] == 4 and sent == 10
    assert extra["rollout/dynamic_sampling_kept_groups"] == 2
    assert extra["rollout/dynamic_sampling_generated_groups"] == 4

    monkeypatch.setattr(generate_module, "can_abort", lambda cfg, engine: False)
    for url in engines.urls:
        assert call(url + "/test_hold", {"after": None})[0] == 200
    full, full_extra = one_step(tiny_ckpt, addition_data, tmp_path, engines)
    assert sum(c["generate_requests"] for c in counts(engines)) == sent + 16  # everything generated this time
    assert full_extra["rollout/dynamic_sampling_generated_groups"] == 8
    assert dicts_without_engine(groups, engines.urls) == dicts_without_engine(full, engines.urls)
    assert [s.metadata["prompt_index"] for g in groups for s in g] == [1, 1, 3, 3]
