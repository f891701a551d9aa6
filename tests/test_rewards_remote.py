"""remote_rm against a real local HTTP server: retries with backoff, request body, bounded concurrency, errors."""

from __future__ import annotations

import time

import pytest
from helpers.reward_server import RewardServer
from helpers.rollout import reward_config

from lichen.config.rollout_config import RewardConfig
from lichen.errors import ConfigError
from lichen.rewards import build_reward_fn, score_samples
from lichen.types import Sample, Status


def rm_args(url: str, **kw) -> RewardConfig:
    """The reward settings of a run against the RM at `url` (RewardConfig field names)."""
    return reward_config(**{**dict(rm_url=url, rm_retry_backoff=0.01, timeout=10.0), **kw})


def sample(i: int, response: str, label: str, **metadata) -> Sample:
    return Sample(prompt=f"p{i}", response=response, label=label, index=i, metadata=dict(metadata))


def test_fails_twice_then_answers():
    with RewardServer(fail_first=2) as server:
        args = rm_args(server.url)
        fn = build_reward_fn("remote_rm", None, args)
        samples = [sample(0, "4", "4", source="gsm"), sample(1, "5", "4")]
        t0 = time.perf_counter()
        stats = score_samples(samples, fn, args)
        elapsed = time.perf_counter() - t0
    assert stats["num_failed"] == 0
    assert [s.reward for s in samples] == [1.0, 0.0]
    assert server.attempts == {"p0": 3, "p1": 3}  # two 500s, then the answer
    first = next(r for r in server.requests if r["prompt"] == "p0")
    assert first == {"prompt": "p0", "response": "4", "label": "4", "metadata": {"source": "gsm"}}
    # backoff: 0.01 s then 0.02 s, each times a jitter in [0.5, 1]
    assert elapsed >= 0.015


def test_retries_exhausted_fail_the_sample():
    with RewardServer(fail_first=10) as server:
        args = rm_args(server.url, rm_max_retries=2)
        samples = [sample(0, "4", "4")]
        stats = score_samples(samples, build_reward_fn("remote_rm", None, args), args)
    assert server.attempts == {"p0": 3}
    assert samples[0].status == Status.FAILED
    assert "no answer after 3 attempts (last: HTTP 500)" in stats["failed"][0][1]


@pytest.mark.parametrize(
    "status,body,cause",
    [(400, "bad request", "answered HTTP 400"), (200, "<html>", "not JSON"), (200, '"yes"', "expected a number")],
)
def test_client_errors_fail_at_once(status, body, cause):
    with RewardServer(status=status, body=body) as server:
        args = rm_args(server.url)
        samples = [sample(0, "4", "4")]
        stats = score_samples(samples, build_reward_fn("remote_rm", None, args), args)
    assert server.attempts == {"p0": 1}  # no retry for a 4xx or a malformed answer
    assert cause in stats["failed"][0][1]


def test_dict_answer_is_a_dict_reward():
    with RewardServer(body='{"score": 0.75, "pred": "x"}') as server:
        args = rm_args(server.url)
        samples = [sample(0, "4", "4")]
        score_samples(samples, build_reward_fn("remote_rm", None, args), args)
    assert samples[0].reward == {"score": 0.75, "pred": "x"}


def test_concurrency_is_bounded():
    with RewardServer(delay_s=0.05) as server:
        args = rm_args(server.url, concurrency=3)
        samples = [sample(i, "1", "1") for i in range(9)]
        stats = score_samples(samples, build_reward_fn("remote_rm", None, args), args)
    assert stats["num_failed"] == 0 and all(s.reward == 1.0 for s in samples)
    assert server.max_in_flight == 3


def test_unreachable_server_fails_after_retries():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens here now
    args = rm_args(f"http://127.0.0.1:{port}/r", rm_max_retries=1)
    samples = [sample(0, "4", "4")]
    stats = score_samples(samples, build_reward_fn("remote_rm", None, args), args)
    assert "no answer after 2 attempts" in stats["failed"][0][1]


def test_needs_url():
    with pytest.raises(ConfigError, match="--rm-url"):
        build_reward_fn("remote_rm", None, reward_config(rm_url=None))
    with pytest.raises(ConfigError, match="--rm-url"):
        build_reward_fn("remote_rm", None, reward_config(rm_url="localhost:9"))
