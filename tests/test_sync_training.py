"""Training over `lichen serve` engines with each weight-sync transport gives the in-process run's samples.

Three steps of the tiny RL run: in process (direct tensor copy), then over two real servers with nccl (gloo on
CPU), full disk and delta disk sync. The same sampling seeds and weights must give the same tokens, rewards and
losses; log-probs agree up to batch-shape rounding. The servers are started once for the module and given to the
runs as external engines, so each run's first sync (version 0) is what brings them to the trainer's weights.
"""

from __future__ import annotations

import os

import pytest
from helpers.runs import base_args, dumped_samples, pop_engines, run

from lichen.engines.api.auth import ENGINE_ADMIN_KEY_ENV, ENGINE_KEY_ENV
from lichen.engines.clients.launcher import EngineLauncher

THREADS = ["--num-threads", "1"]


@pytest.fixture(scope="module")
def addrs(tiny_ckpt, tmp_path_factory):
    tmp = str(tmp_path_factory.getbasetemp())  # the runs' weight dirs are below it
    launcher = EngineLauncher(
        tiny_ckpt,
        2,
        server_args=[*THREADS, "--weight-dir", tmp, "--local-checkpoint-dir", tmp],
        log_dir=str(tmp_path_factory.mktemp("logs")),
    )
    urls = launcher.start()
    # the runs use them as external engines: their keys go through the environment, as a user's would
    keys = {ENGINE_KEY_ENV: launcher.api_key, ENGINE_ADMIN_KEY_ENV: launcher.admin_api_key}
    before = {k: os.environ.get(k) for k in keys}
    os.environ.update(keys)
    yield [u.replace("http://", "") for u in urls]
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    launcher.stop()


@pytest.fixture(scope="module")
def in_process(tiny_ckpt, addition_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("local")
    dump = str(out / "r_{rollout_id}.pt")
    metrics = run(
        base_args(
            tiny_ckpt, addition_data, out / "o", "--num-rollout", "3", *THREADS, "--save-debug-rollout-data", dump
        )
    )
    return dump, metrics


WRITTEN: list[str] = []


def record_version(path: str) -> None:
    """--custom-update-weight-post-write-path hook: sees each version directory once it is complete."""
    assert any(f.endswith(".safetensors") for f in os.listdir(path)), path
    WRITTEN.append(os.path.basename(path))


def _samples(path: str) -> list[dict]:
    return dumped_samples(path)


@pytest.mark.parametrize("transport", ["nccl", "disk-full", "disk-delta"])
@pytest.mark.slow
def test_three_steps_over_two_engines_match_in_process(
    tiny_ckpt, addition_data, tmp_path, addrs, in_process, transport
):
    local_dump, local_metrics = in_process
    flags = {
        "nccl": [],
        "disk-full": ["--update-weight-transport", "disk", "--update-weight-disk-dir", str(tmp_path / "w")],
        "disk-delta": [
            "--update-weight-transport",
            "disk",
            "--update-weight-disk-dir",
            str(tmp_path / "w"),
            "--update-weight-mode",
            "delta",
            "--update-weight-local-checkpoint-dir",
            str(tmp_path / "local"),
        ],
    }[transport]
    if transport != "nccl":
        flags += ["--custom-update-weight-post-write-path", "test_sync_training.record_version"]
    WRITTEN.clear()
    dump = str(tmp_path / "r_{rollout_id}.pt")
    remote = run(
        base_args(
            tiny_ckpt,
            addition_data,
            tmp_path / "o",
            "--num-rollout",
            "3",
            *THREADS,
            "--save-debug-rollout-data",
            dump,
            "--rollout-external-engine-addrs",
            *addrs,
            *flags,
        )
    )
    for step in range(3):
        a, b = _samples(local_dump.format(rollout_id=step)), _samples(dump.format(rollout_id=step))
        assert len(a) == len(b) == 16
        for x, y in zip(a, b):
            lp_x, lp_y = x.pop("rollout_log_probs"), y.pop("rollout_log_probs")
            assert pop_engines(x) == [] and {u.split("//")[1] for u in pop_engines(y)} <= set(addrs)
            assert x == y  # tokens, response, reward, status, weight_versions, indices: identical
            assert max(abs(p - q) for p, q in zip(lp_x, lp_y)) <= 1e-5
        assert {tuple(s["weight_versions"]) for s in b} == {(str(step),)}
    for m_a, m_b in zip(local_metrics, remote):
        assert abs(m_a["train/loss"] - m_b["train/loss"]) <= 1e-5
        assert m_b["sync/weight_version"] == m_a["step"]
        assert m_b[f"sync/transport_{transport.split('-')[0]}"] == 1
        assert m_b["sync/verified_tensors"] == 2 * 20  # every tensor of the tiny model, on both engines
    first = {"nccl": None, "disk-full": 0, "disk-delta": 1}[transport]  # delta: version 0 is the engines' own
    assert WRITTEN == ([] if first is None else [f"weight_v{v:06d}" for v in range(first, 4)])
    if transport == "disk-delta":
        assert [m["sync/is_delta"] for m in remote] == [0, 1, 1]  # version 1 starts the chain
        assert sorted(os.listdir(tmp_path / "w")) == ["weight_v000001", "weight_v000002", "weight_v000003"]


# ---- closing the transports ---------------------------------------------------------------------------------
class _Transport:
    def __init__(self, log: list, fail: bool = False):
        self.log, self.fail = log, fail

    def close(self):
        self.log.append("transport.close")
        if self.fail:
            raise RuntimeError("engine already gone")


def test_close_releases_every_transport_once_and_never_raises():
    from types import SimpleNamespace

    from lichen import sync

    log: list = []
    engines = [SimpleNamespace(), SimpleNamespace(), SimpleNamespace()]
    setattr(engines[0], sync._STATE_ATTR, {"transport": _Transport(log, fail=True)})
    setattr(engines[1], sync._STATE_ATTR, {"transport": _Transport(log)})
    rollout = SimpleNamespace(engines=engines)
    sync.close(rollout)  # the first transport's error is logged, the second is still closed
    assert log == ["transport.close", "transport.close"]
    assert all(getattr(e, sync._STATE_ATTR, None) is None for e in engines)
    sync.close(rollout)
    sync.close(SimpleNamespace())  # a rollout without engines (a replay)
    assert len(log) == 2


def test_run_closes_the_transports_before_the_rollout(monkeypatch):
    from types import SimpleNamespace

    import lichen.loop as loop

    order: list = []
    rollout = SimpleNamespace(close=lambda: order.append("rollout.close"))
    monkeypatch.setattr(loop, "prepare_output_dir", lambda args: None)
    monkeypatch.setattr(loop, "start_cluster", lambda args: None)
    monkeypatch.setattr(loop, "build_rollout", lambda args, cluster: rollout)
    monkeypatch.setattr(loop, "resolve_num_rollout", lambda args, r: None)

    def no_trainer(args, cluster):
        raise RuntimeError("trainer failed to build")

    monkeypatch.setattr(loop, "build_trainer", no_trainer)
    monkeypatch.setattr(loop.sync, "close", lambda r: order.append(("sync.close", r)))
    with pytest.raises(RuntimeError, match="trainer failed"):
        loop.run(SimpleNamespace())
    assert order == [("sync.close", rollout), "rollout.close"]
