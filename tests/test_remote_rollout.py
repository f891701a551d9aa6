"""Rollout over `lichen serve` processes: RemoteEngines, full disk weight sync, the launcher, the server flags.

Real servers on loopback ports throughout: one module-scoped pair for the engine-level checks, and the training
runs launch their own (--rollout-num-engines) so the launcher's start and stop are part of what is tested.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch
from helpers.batch_schedule import assert_mostly_same_generations
from helpers.runs import THREADS, base_args, dumped_samples, run

from lichen.cli import main
from lichen.config import parse_train_args
from lichen.config.engine_config import required_endpoints
from lichen.engines.clients.client import EngineError
from lichen.engines.core.engine import Engine, GenRequest
from lichen.engines.core.sampler import derive_seed
from lichen.errors import ConfigError
from lichen.rollout.generate import generate_rollout
from lichen.sync.disk import push_full, write_version
from lichen.weights.hf_io import load_hf_state_dict
from lichen.weights.versions import version_dir


def requests(n: int = 10) -> list[GenRequest]:
    out = []
    for i in range(n):
        ids = [(7 * i + 3 * k) % 90 + 1 for k in range(3 + i % 5)]
        temperature, top_p = [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)][i % 3]
        out.append(
            GenRequest(
                input_ids=ids, max_new_tokens=6 + i % 3, temperature=temperature, top_p=top_p, seed=derive_seed(7, 0, i)
            )
        )
    return out


def assert_same_results(remote, local, version: str) -> None:
    """Same seeds, other batch schedule (server batches vs one local batch): the same tokens but for a rare
    rounding flip between near-tied tokens (at most one of the requests)."""
    assert len(remote) == len(local)
    flips = assert_mostly_same_generations(
        [(r.output_ids, r.output_logprobs, loc.output_ids, loc.output_logprobs) for r, loc in zip(remote, local)],
        max_flips=1,
    )
    for r, loc in zip(remote, local):
        assert r.weight_version == version and r.prompt_tokens == loc.prompt_tokens
        if not flips:
            assert r.finish_reason == loc.finish_reason


def perturbed(ckpt: str, scale: float) -> dict[str, torch.Tensor]:
    state = load_hf_state_dict(ckpt)
    gen = torch.Generator().manual_seed(0)
    return {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in state.items()}


class FakeTrainer:
    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state

    def named_weights(self):
        return iter(self.state.items())


# ---- engine level -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_generate_over_two_servers_matches_in_process(pair, tiny_ckpt):
    reqs = requests()
    before = list(pair.router.routed)
    remote = pair.generate(reqs)
    assert_same_results(remote, Engine.from_pretrained(tiny_ckpt).generate(reqs), "default")
    spread = [b - a for a, b in zip(before, pair.router.routed)]
    assert sum(spread) == len(reqs) and min(spread) > 0  # both engines served
    assert pair.weight_version == "default"
    assert pair.generate([]) == []


def test_update_from_disk_changes_outputs_and_a_bad_path_keeps_old_weights(pair, tiny_ckpt, tmp_path):
    state = perturbed(tiny_ckpt, 0.05)
    path = write_version(iter(state.items()), str(tmp_path), 5, tiny_ckpt)
    assert path == version_dir(str(tmp_path), 5) and path.endswith("weight_v000005")
    pair.update_weights_from_disk(path, "5")
    assert pair.weight_versions() == ["5", "5"]
    local = Engine.from_pretrained(tiny_ckpt)
    local.update_weights_from_tensors(state.items(), "5")
    reqs = requests(6)
    expected = local.generate(reqs)
    assert expected != Engine.from_pretrained(tiny_ckpt).generate(reqs)  # the update does change outputs
    assert_same_results(pair.generate(reqs), expected, "5")

    with pytest.raises(EngineError, match="update_weights_from_disk answered HTTP 400"):
        pair.update_weights_from_disk(str(tmp_path / "missing"), "6")
    assert pair.weight_versions() == ["5", "5"]
    # old weights still serve, and generation was continued (a paused server would block here)
    assert_same_results(pair.generate(reqs), expected, "5")


def test_push_full_writes_checks_and_prunes_versions(pair, tiny_ckpt, tmp_path):
    class Rollout:
        engines = [pair]

    trainer = FakeTrainer(load_hf_state_dict(tiny_ckpt))
    root = tmp_path / "w"
    root.mkdir()
    (root / "notes").mkdir()  # not a version directory: left alone
    for version in (1, 2):
        metrics = push_full(trainer, Rollout.engines, version, disk_dir=str(root), hf_checkpoint=tiny_ckpt)
        assert metrics["sync/weight_version"] == version and metrics["sync/bytes"] > 0
    assert sorted(os.listdir(root)) == ["notes", "weight_v000002"]
    assert pair.weight_version == "2"
    push_full(trainer, Rollout.engines, 3, disk_dir=str(root), hf_checkpoint=tiny_ckpt, keep_files=True)
    assert sorted(os.listdir(root)) == ["notes", "weight_v000002", "weight_v000003"]
    saved = load_hf_state_dict(str(root / "weight_v000003"))
    assert all(torch.equal(saved[k], v) for k, v in trainer.state.items())
    assert os.path.isfile(root / "weight_v000003" / "tokenizer.json")  # the servers get a complete checkpoint


def test_offload_onload_follow_the_memory_tags(pair):
    def released():
        return [
            pair.run(c.call_json("GET", "/server_info"))["internal_states"][0]["released_memory"] for c in pair.clients
        ]

    pair.offload()
    assert released() == [["cuda_graph", "kv_cache", "weights"]] * 2
    pair.onload(["weights"])
    assert released() == [["cuda_graph", "kv_cache"]] * 2
    pair.onload(["kv_cache"])  # brings cuda_graph back with it, as SGLang's sequence does
    assert released() == [[], []] and not pair.released
    assert len(pair.generate(requests(2))) == 2


def test_missing_endpoints_are_named(pair):
    with pytest.raises(ConfigError) as info:
        pair.require_endpoints({"/generate": "rollout", "/no_such_endpoint": "--some-feature"})
    msg = str(info.value)
    assert all(f"{url} lacks /no_such_endpoint (needed by --some-feature)" in msg for url in pair.urls)
    assert "/generate" not in msg


# ---- flags --------------------------------------------------------------------------------------------------
def _parse(tiny_ckpt, addition_data, tmp_path, *extra):
    return parse_train_args(base_args(tiny_ckpt, addition_data, tmp_path / "o", "--num-rollout", "1", *extra)[1:])


def test_server_engine_flags(tiny_ckpt, addition_data, tmp_path):
    disk = ["--update-weight-transport", "disk", "--update-weight-disk-dir", str(tmp_path / "w")]
    args = _parse(tiny_ckpt, addition_data, tmp_path, "--rollout-num-engines", "2", *disk, "--offload-rollout")
    need = required_endpoints(args)
    assert need["/update_weights_from_disk"] == "--update-weight-transport disk"
    assert need["/release_memory_occupation"] == "--offload-rollout"
    _parse(
        tiny_ckpt,
        addition_data,
        tmp_path,
        "--rollout-external-engine-addrs",
        "127.0.0.1:30000",
        "http://h:1",
        "--rollout-external-engine-api-key-file",
        "k.key",
        *disk,
    )
    _parse(tiny_ckpt, addition_data, tmp_path, "--rollout-num-engines", "2", "--debug-rollout-only")  # no sync
    _parse(tiny_ckpt, addition_data, tmp_path, "--rollout-num-engines", "2")  # nccl (gloo on CPU), the default
    _parse(
        tiny_ckpt,
        addition_data,
        tmp_path,
        "--rollout-num-engines",
        "2",
        "--update-weight-mode",
        "delta",
        *disk,
        "--update-weight-local-checkpoint-dir",
        str(tmp_path),
    )
    cases = [
        (["--rollout-num-engines", "0", *disk], ConfigError, "--rollout-num-engines 0"),
        (
            ["--rollout-num-engines", "1", "--rollout-external-engine-addrs", "h:1", *disk],
            ConfigError,
            "exclude each other",
        ),
        (["--rollout-external-engine-addrs", "nohostport", *disk], ConfigError, "expected HOST:PORT"),
        (["--rollout-external-engine-addrs", "h:1", "h:1", *disk], ConfigError, "given twice"),
        (
            ["--rollout-external-engine-api-key-file", "k"],
            ConfigError,
            "only used with --rollout-external-engine-addrs",
        ),
        (
            ["--rollout-external-engine-addrs", "h:1", "--rollout-max-batch-size", "4", *disk],
            ConfigError,
            "--rollout-max-batch-size",
        ),
        ([*disk], ConfigError, "--update-weight-transport applies to server engines"),
    ]
    for extra, kind, text in cases:
        with pytest.raises(kind) as info:
            _parse(tiny_ckpt, addition_data, tmp_path, *extra)
        assert text in str(info.value), (extra, str(info.value))


def test_unreachable_external_engine_is_a_user_error(tiny_ckpt, addition_data, tmp_path, capsys):
    argv = base_args(
        tiny_ckpt,
        addition_data,
        tmp_path / "o",
        "--num-rollout",
        "1",
        "--rollout-external-engine-addrs",
        "127.0.0.1:9",
        "--update-weight-transport",
        "disk",
        "--update-weight-disk-dir",
        str(tmp_path / "w"),
    )
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--rollout-external-engine-addrs: cannot reach" in err and "127.0.0.1:9" in err


# ---- training over launched servers ---------------------------------------------------------------------------
def _response(sample: dict) -> list[int]:
    return sample["tokens"][len(sample["tokens"]) - sample["response_length"] :]


def _samples(path: str) -> list[dict]:
    return dumped_samples(path)


@pytest.mark.slow
def test_training_over_two_launched_engines_matches_in_process(tiny_ckpt, addition_data, tmp_path, launched):
    common = ["--num-rollout", "3", "--offload-rollout", *THREADS]  # offload: release/resume around each sync
    dump = str(tmp_path / "{}" / "r_{{rollout_id}}.pt")
    local = run(
        base_args(tiny_ckpt, addition_data, tmp_path / "a", *common, "--save-debug-rollout-data", dump.format("a"))
    )
    wdir = tmp_path / "weights"
    remote = run(
        base_args(
            tiny_ckpt,
            addition_data,
            tmp_path / "b",
            *common,
            "--save-debug-rollout-data",
            dump.format("b"),
            "--rollout-num-engines",
            "2",
            "--update-weight-transport",
            "disk",
            "--update-weight-disk-dir",
            str(wdir),
        )
    )
    # One engine batch of 16 vs two servers' batches: a near-tied token can flip (docs/architecture.md#batch-schedules:
    # identical tokens only for identical batch schedules). Until a flip the runs are the same; after it they train
    # on other data.
    same_so_far = True
    for step in range(3):
        a = _samples(dump.format("a").format(rollout_id=step))
        b = _samples(dump.format("b").format(rollout_id=step))
        assert len(a) == len(b) == 16
        assert {tuple(s["weight_versions"]) for s in b} == {(str(step),)}  # engines took every disk sync
        assert [(s["group_index"], s["index"]) for s in a] == [(s["group_index"], s["index"]) for s in b]
        # which server made a sample is the one thing the runs cannot share: the in-process engine has no URL, and
        # every remote sample names one of the two servers (both served)
        assert not any("engine" in s["metadata"] for s in a)
        engines = [s["metadata"].pop("engine") for s in b]
        assert len(set(engines)) == 2 and all(re.fullmatch(r"http://127\.0\.0\.1:\d+", e) for e in engines)
        if not same_so_far:
            continue
        flips = assert_mostly_same_generations(
            [(_response(x), x["rollout_log_probs"], _response(y), y["rollout_log_probs"]) for x, y in zip(a, b)],
            max_flips=2,
        )
        for x, y in zip(a, b):
            if x["tokens"] == y["tokens"]:
                x.pop("rollout_log_probs"), y.pop("rollout_log_probs")
                assert x == y  # response, reward, status, weight_versions, indices: identical
        if flips:
            same_so_far = False
        else:
            assert abs(local[step]["train/loss"] - remote[step]["train/loss"]) <= 1e-5
    for m_a, m_b in zip(local, remote):
        assert m_b["sync/weight_version"] == m_a["step"]
    assert os.listdir(wdir) == ["weight_v000003"]
    assert len(launched) == 1 and len(launched[0].pids) == 2
    assert not any(launched[0].alive())  # the run stopped its servers


def failing_rollout(args, rollout_id, data_source, evaluation=False):
    generate_rollout(args, rollout_id, data_source)  # the servers did work ...
    raise RuntimeError("rollout plug-in failed")  # ... and then the run fails


@pytest.mark.slow
def test_servers_stop_when_the_run_raises(tiny_ckpt, addition_data, tmp_path, launched):
    argv = base_args(
        tiny_ckpt,
        addition_data,
        tmp_path / "o",
        "--num-rollout",
        "2",
        *THREADS,
        "--rollout-num-engines",
        "1",
        "--update-weight-transport",
        "disk",
        "--update-weight-disk-dir",
        str(tmp_path / "w"),
        "--rollout-function-path",
        "test_remote_rollout.failing_rollout",
    )
    with pytest.raises(RuntimeError, match="rollout plug-in failed"):
        main(argv)
    assert len(launched) == 1 and not any(launched[0].alive())


_LAUNCH_AND_WAIT = """
import signal, sys, time
# A user's shell starts lichen with Ctrl-C live. A pytest-xdist worker may hand its children SIGINT ignored or
# blocked (CI at load 12 once saw a parent sleep through SIGINT): say what was inherited, then restore it.
print("inherited SIGINT:", signal.getsignal(signal.SIGINT), "blocked:", signal.pthread_sigmask(signal.SIG_BLOCK, []),
      file=sys.stderr, flush=True)
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
from lichen.engines.clients.launcher import EngineLauncher
launcher = EngineLauncher(sys.argv[1], 1, server_args=["--num-threads", "1"])
launcher.start()
print("PIDS", *launcher.pids, flush=True)
time.sleep(300)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"  # a zombie has exited (its reaper is not us)
    except FileNotFoundError:
        return True


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; parent-death signal is Linux-only")
def test_launched_servers_die_with_their_parent(tiny_ckpt):
    """Ctrl-C (SIGINT), SIGTERM and even SIGKILL of the launching process take its servers down."""
    sigs = [signal.SIGINT, signal.SIGTERM, signal.SIGKILL]
    errs = [tempfile.TemporaryFile(mode="w+") for _ in sigs]  # each parent's stderr, quoted if it hangs
    parents = [
        subprocess.Popen(
            [sys.executable, "-X", "faulthandler", "-c", _LAUNCH_AND_WAIT, tiny_ckpt],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        for err in errs
    ]
    servers = []
    try:
        for p in parents:
            line = p.stdout.readline()
            assert line.startswith("PIDS"), f"launcher script failed (exit {p.poll()})"
            servers.append(int(line.split()[1]))
        assert not any(_gone(pid) for pid in servers)
        for p, sig in zip(parents, sigs):
            p.send_signal(sig)
        codes = []
        for p, sig, err in zip(parents, sigs, errs):
            try:  # generous: the parent's atexit stops its server with a 10 s grace, slow on a loaded machine
                codes.append(p.wait(180))
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGABRT)  # -X faulthandler prints every thread's stack
                p.wait(30)
                err.seek(0)
                pytest.fail(
                    f"the launcher did not exit within 180 s of {signal.Signals(sig).name}; its stderr:\n"
                    f"{err.read()[-4000:]}"
                )
        assert codes[1] == 128 + signal.SIGTERM and codes[2] == -signal.SIGKILL
        end = time.monotonic() + 30
        while not all(_gone(pid) for pid in servers) and time.monotonic() < end:
            time.sleep(0.1)
        assert [_gone(pid) for pid in servers] == [True, True, True]
    finally:
        for p, err in zip(parents, errs):
            if p.poll() is None:
                p.kill()
            err.close()
        for pid in servers:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
