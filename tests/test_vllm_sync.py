"""Weight sync into vLLM (lichen.sync.vllm_sync, lichen.engines.clients.vllm_worker_ext; docs/engines.md#weight-sync).

- vLLM's own CUDA protocol, which cannot run here: its request sequence against a scripted HTTP peer;
- one real vLLM server (vLLM's environment, .venv-vllm) launched by lichen for the module: both CPU transports
  (gloo broadcast, /dev/shm) through `lichen.sync.push` change what vLLM serves, record the version and are
  verified; a tensor changed after the sender hashed it is caught;
- a 3-step `lichen train` over launched vLLM engines with the gloo transport and --use-fault-tolerance, engine 0
  SIGKILLed mid-rollout: its requests re-sent to engine 1, it is restarted and re-joins at the next sync (a new
  group), no sample lost or duplicated, every sync verified. Two engines: a broadcast leaves no checkpoint for a
  lone restarted engine to load mid-rollout (lichen.engines.clients.health), as for every broadcast transport.
- `--runtime ray`: 2 trainer ranks and a vLLM engine actor, trainer rank 0 broadcasting, every sync verified;
- the receiver's input checks, and the health probe that catches a hung vLLM engine core.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch
from helpers.engine_kill import kill_when_busy
from helpers.runs import THREADS, base_args, read_dump, run
from helpers.vllm import vllm_python, vllm_tiny_model

from lichen import sync
from lichen.config import parse_train_args
from lichen.config.engine_config import EngineConfig, SyncConfig
from lichen.engines.clients.remote_engines import RemoteEngines
from lichen.engines.clients.vllm_client import VLLMClient
from lichen.engines.core.engine import GenRequest
from lichen.errors import NotAvailableYet
from lichen.models import load_model
from lichen.sync.verify import WeightMismatchError
from lichen.sync.vllm_sync import VLLMNativeSync
from lichen.weights.hf_io import load_hf_state_dict

pytestmark = pytest.mark.e2e  # see the marker in pyproject.toml: make test leaves it to make test-e2e

VLLM_FLAGS = ["--vllm-max-model-len", "512", "--vllm-optimization-level", "0"]  # -O0: no torch.compile at start


# ---- vLLM's CUDA protocol against a scripted peer ---------------------------------------------------------------
class _Peer(BaseHTTPRequestHandler):
    calls: list = []

    def log_message(self, *a):
        pass

    def _answer(self, obj) -> None:
        raw = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):
        self.calls.append(("GET", self.path, None))
        self._answer({"world_size": 2} if self.path.startswith("/get_world_size") else {"weight_version": "7"})

    def do_POST(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(n) or b"null")
        self.calls.append(("POST", self.path, body))
        self._answer({"status": "ok"})


def test_cuda_protocol_request_sequence_against_a_scripted_peer():
    _Peer.calls = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Peer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    engines = RemoteEngines([f"http://127.0.0.1:{server.server_address[1]}"], client_cls=VLLMClient)
    sent: list = []

    class Trainer:  # stands in for vLLM's trainer-side NCCL engine: records what it broadcasts
        def send(self, names, dtype_names, shapes, tensors):
            sent.append((names, dtype_names, shapes))

    inits: list = []
    transport = VLLMNativeSync(engines, buffer_size=210, trainer_engine=lambda init: inits.append(init) or Trainer())
    named = [("a", torch.ones(10, 10)), ("b", torch.ones(5, dtype=torch.bfloat16)), ("c", torch.ones(3, 3))]
    try:
        transport.push(named, 7, torch.bfloat16)
        transport.push(named, 8, torch.bfloat16)  # the group is kept: no second init
    finally:
        engines.close()
        server.shutdown()
    paths = [p for _, p, _ in _Peer.calls]
    assert paths[:2] == ["/get_world_size?include_dp=false", "/init_weight_transfer_engine"]
    init = _Peer.calls[1][2]["init_info"]
    assert init["rank_offset"] == 1 and init["world_size"] == 3  # the trainer + the engine's 2 workers
    assert init["packed"] is False  # the trainer's side broadcasts tensor by tensor
    assert inits == [{"master_address": "127.0.0.1", "master_port": init["master_port"], "world_size": 3}]
    one_sync = [
        "/pause?mode=abort",
        "/reset_prefix_cache",
        "/start_weight_update",
        "/update_weights",  # a (200 bytes in bfloat16) and b (10) fill one 210-byte bucket ...
        "/update_weights",  # ... c alone
        "/finish_weight_update",
        "/resume",
    ]
    assert paths[2:] == one_sync + one_sync, paths
    updates = [b for _, p, b in _Peer.calls if p == "/update_weights"]
    assert updates[0]["update_info"] == {
        "names": ["a", "b"],
        "dtype_names": ["bfloat16"] * 2,
        "shapes": [[10, 10], [5]],
    }
    assert [b for _, p, b in _Peer.calls if p == "/finish_weight_update"] == [
        {"weight_version": "7"},
        {"weight_version": "8"},
    ]
    assert sent == [
        (u["update_info"]["names"], u["update_info"]["dtype_names"], u["update_info"]["shapes"]) for u in updates
    ]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return vllm_tiny_model(str(tmp_path_factory.mktemp("vllm_sync_tiny")))


def test_offload_maps_to_sleep_and_wake_up_and_is_refused_on_cpu(ckpt, tmp_path, addition_data):
    _Peer.calls = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Peer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    engines = RemoteEngines([f"http://127.0.0.1:{server.server_address[1]}"], client_cls=VLLMClient)
    try:
        engines.offload()
        engines.onload(["weights"])
        engines.onload()
    finally:
        engines.close()
        server.shutdown()
    paths = [p for _, p, _ in _Peer.calls]
    assert paths == ["/reset_prefix_cache", "/sleep?level=1", "/wake_up?tags=weights", "/wake_up?tags=kv_cache"]
    argv = ["--hf-checkpoint", ckpt, "--prompt-data", addition_data, "--num-rollout", "1", "--output-dir"]
    argv += [str(tmp_path), "--rollout-engine-backend", "vllm", "--rollout-num-engines", "1", "--offload-rollout"]
    with pytest.raises(NotAvailableYet, match="Sleep mode is not supported on current platform"):
        parse_train_args(argv)


# ---- one real vLLM server ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(ckpt, tmp_path_factory, addition_data):
    vllm_python()  # fails (or skips with LICHEN_SKIP_VLLM=1) without vLLM's environment
    out = tmp_path_factory.mktemp("vllm_sync_run")
    argv = base_args(
        ckpt, addition_data, out, "--num-rollout", "1", "--rollout-engine-backend", "vllm", "--rollout-num-engines", "1"
    )
    cfg = EngineConfig.from_args(parse_train_args([*argv[1:], *VLLM_FLAGS]))
    engines = RemoteEngines.from_config(cfg)
    try:
        yield engines
    finally:
        engines.close()


def _cfg(transport: str) -> SyncConfig:
    return SyncConfig(transport, "full", 1 << 16, None, None, "", "raw", "xxh3-128", 0, False, None, False)


def _push(engines, weights: dict, version: int, transport: str) -> dict:
    trainer = SimpleNamespace(named_weights=lambda: iter(weights.items()))
    rollout = SimpleNamespace(engines=[engines])
    return sync.push(trainer, rollout, version, _cfg(transport))


PROMPT = [5, 6, 7, 8]


def _greedy(engines) -> tuple[list[int], list[float]]:
    r = engines.generate([GenRequest(PROMPT, 6, seed=0, temperature=0.0, ignore_eos=True)])[0]
    return r.output_ids, r.output_logprobs


def _reference(ckpt: str, weights: dict, output: list[int]) -> list[float]:
    """Log-probs of `output` after PROMPT under `weights`, from lichen's own model in float64."""
    model = load_model(ckpt, dtype=torch.float64).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name].double())
        ids = torch.tensor([PROMPT + output])
        logits = model.logits(model(ids, torch.arange(ids.shape[1])[None]))[0]
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[len(PROMPT) - 1 + i, t]) for i, t in enumerate(output)]


@pytest.mark.parametrize("transport", ["nccl", "tensor"])
@pytest.mark.slow
def test_each_cpu_transport_changes_what_vllm_serves_records_the_version_and_is_verified(engines, ckpt, transport):
    base = load_hf_state_dict(ckpt)
    try:
        before = _greedy(engines)
        moved = {n: (t * 1.5 if n.endswith("norm.weight") else t + 0.05 * torch.randn_like(t)) for n, t in base.items()}
        metrics = _push(engines, moved, 1, transport)
        assert metrics["sync/verified_tensors"] == len(base) and metrics["sync/weight_version"] == 1
        assert engines.weight_versions() == ["1"]
        tokens, logprobs = _greedy(engines)
        # the served model is the sent one, LM head included (tied to the embedding: vLLM's reload skips it);
        # 1e-3: float32 kernels against float64 (tests/test_vllm_protocol.py's bound), far below the moved weights'
        ref = _reference(ckpt, moved, tokens)
        assert max(abs(a - b) for a, b in zip(logprobs, ref)) <= 1e-3, (logprobs, ref)
        assert logprobs != before[1]
        _push(engines, base, 2, transport)
        assert engines.weight_versions() == ["2"]
        after = _greedy(engines)
        assert after[0] == before[0] and max(abs(a - b) for a, b in zip(after[1], before[1])) <= 1e-5
    finally:
        sync.close(SimpleNamespace(engines=[engines]))


def test_a_tensor_changed_after_the_sender_hashed_it_is_caught(engines, ckpt, monkeypatch):
    import lichen.weights.rank_send as rank_send

    base = load_hf_state_dict(ckpt)
    weights = {n: t.clone() for n, t in base.items()}
    victim = sorted(base)[len(base) // 2]
    real = rank_send.tensor_checksum
    seen: list[int] = []

    def hash_then_corrupt(t):
        digest = real(t)
        if t.data_ptr() == weights[victim].data_ptr() and not seen:  # the sender casts float32 to float32: no copy
            seen.append(1)
            t.view(-1)[0] += 1.0  # after hashing, before the bytes leave: what a broken transfer would do
        return digest

    monkeypatch.setattr(rank_send, "tensor_checksum", hash_then_corrupt)
    try:
        with pytest.raises(WeightMismatchError) as info:
            _push(engines, weights, 3, "nccl")
    finally:
        sync.close(SimpleNamespace(engines=[engines]))
    assert seen and victim in str(info.value) and "differ from the trainer's" in str(info.value), str(info.value)


@pytest.mark.slow
def test_the_health_probe_catches_a_hung_engine_core_that_vllm_health_calls_healthy(engines):
    """vLLM's /health checks only that its engine core has not died: a hung one (SIGSTOP) still answers 200. The
    health monitor's probe through VLLMClient generates one token, as SGLang's /health_generate does."""
    import os
    import signal
    import urllib.request

    import psutil

    from lichen.engines.clients.health import HealthMonitor

    server = psutil.Process(engines.launcher.servers[0].proc.pid)
    cores = [p for p in server.children(recursive=True) if "EngineCore" in " ".join(p.cmdline()) + p.name()]
    assert len(cores) == 1, [(p.pid, p.name(), p.cmdline()) for p in server.children(recursive=True)]
    monitor = HealthMonitor(engines, timeout=5.0)
    assert engines.run(monitor.probe(0)) == (True, "")
    os.kill(cores[0].pid, signal.SIGSTOP)
    try:
        with urllib.request.urlopen(engines.urls[0] + "/health", timeout=30) as r:
            assert r.status == 200  # vLLM itself: healthy
        healthy, why = engines.run(monitor.probe(0))
    finally:
        os.kill(cores[0].pid, signal.SIGCONT)
    assert not healthy and "no answer within 5 s" in why, why
    # resumed, it answers again: the first probes may still time out behind the work queued while it was stopped
    # (seen once under a load average of 35), so up to 6 probes
    answers = []
    while len(answers) < 6 and answers[-1:] != [(True, "")]:
        answers.append(engines.run(monitor.probe(0)))
    assert answers[-1] == (True, ""), answers


# ---- a training run, the engine killed mid-rollout ---------------------------------------------------------------
SEEN: dict = {}


def killing_rollout(args, rollout_id, data_source, evaluation=False):
    """Step 1: SIGKILL engine 0 while it has a request in flight. Every step: what the engines report."""
    from lichen.rollout.context import current
    from lichen.rollout.generate import generate_rollout

    engines = current().engine
    SEEN.setdefault("versions", []).append(engines.weight_versions())
    SEEN.setdefault("restarts", []).append(list(engines.monitor.restarts))
    if rollout_id != 1:
        return generate_rollout(args, rollout_id, data_source)
    killer = kill_when_busy(engines, 0, SEEN, timeout=120)
    groups = generate_rollout(args, rollout_id, data_source)
    killer.join()
    return groups


@pytest.mark.slow
def test_train_three_steps_over_vllm_with_the_gloo_transport_and_an_engine_killed_mid_rollout(
    ckpt, addition_data, tmp_path
):
    vllm_python()
    SEEN.clear()
    dump = str(tmp_path / "r_{rollout_id}.pt")
    metrics = run(
        base_args(
            ckpt,
            addition_data,
            tmp_path / "o",
            "--num-rollout",
            "3",
            *THREADS,
            "--rollout-engine-backend",
            "vllm",
            "--rollout-num-engines",
            "2",
            *VLLM_FLAGS,
            "--update-weight-transport",
            "nccl",
            "--check-weight-update-equal",
            "--sglang-server-concurrency",
            "2",
            "--use-fault-tolerance",
            "--rollout-health-check-interval",
            "0.5",
            "--rollout-health-check-timeout",
            "30",
            "--rollout-health-check-first-wait",
            "0",
            "--rollout-function-path",
            "test_vllm_sync.killing_rollout",
            "--save-debug-rollout-data",
            dump,
        )
    )
    steps = [m for m in metrics if "train/train_rollout_logprob_abs_diff" in m]
    diffs = [m["train/train_rollout_logprob_abs_diff"] for m in steps]
    print("train_rollout_logprob_abs_diff per step:", diffs)
    assert len(diffs) == 3 and all(0 <= d < 0.05 for d in diffs), diffs
    syncs = [m for m in metrics if "sync/verified_tensors" in m]
    assert len(syncs) >= 3 and all(m["sync/verified_tensors"] > 0 for m in syncs), syncs
    assert all(m.get("sync/transport_nccl") == 1 for m in syncs)
    assert SEEN["in_flight_at_kill"] >= 1 and SEEN["restarts"][2] == [1, 0], SEEN["restarts"]
    for k in range(3):  # every group whole, no sample twice, each at the version of its step
        groups = read_dump(dump.format(rollout_id=k))["samples"]
        assert [len(g) for g in groups] == [4, 4, 4, 4]
        assert sorted(s["index"] for g in groups for s in g) == list(range(16))
    # the restarted engine re-joined at the next sync (a new gloo group with both): both at step 2's version
    assert SEEN["versions"][2] == ["2", "2"], SEEN["versions"]


@pytest.mark.slow
def test_ray_two_trainer_ranks_sync_into_a_vllm_engine_actor_by_gloo(ckpt, addition_data, tmp_path):
    """--runtime ray: 2 trainer ranks and 1 vLLM engine actor; trainer rank 0 broadcasts (the driver holds no
    tensor), every sync verified against the checksums rank 0 sent."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'lichen[ray]')")
    from helpers.ray_local import shared_ray

    vllm_python()
    shared_ray()
    ray_args = ["--runtime", "ray", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1"]
    metrics = run(
        base_args(
            ckpt,
            addition_data,
            tmp_path / "o",
            "--num-rollout",
            "3",
            "--device",
            "cpu",
            *THREADS,
            *ray_args,
            "--rollout-engine-backend",
            "vllm",
            *VLLM_FLAGS,
            "--update-weight-transport",
            "nccl",
            "--check-weight-update-equal",
        )
    )
    diffs = [m["train/train_rollout_logprob_abs_diff"] for m in metrics if "train/train_rollout_logprob_abs_diff" in m]
    print("--runtime ray: train_rollout_logprob_abs_diff per step:", diffs)
    assert len(diffs) == 3 and all(0 <= d < 0.05 for d in diffs), diffs
    syncs = [m for m in metrics if "sync/verified_tensors" in m]
    assert len(syncs) >= 3 and all(m["sync/verified_tensors"] > 0 and m["sync/transport_nccl"] == 1 for m in syncs)


# ---- the receiver's input checks (no vLLM needed: they run before anything touches the model) ------------------
def test_the_receiver_reads_buckets_only_from_files_in_dev_shm(tmp_path):
    import os

    from lichen.engines.clients.vllm_worker_ext import LichenWeightReceiver

    receiver = LichenWeightReceiver()
    spec = {"total": 4, "names": ["w"], "dtypes": ["float32"], "shapes": [[1]]}
    link = f"/dev/shm/lichen-test-{os.getpid()}"
    os.symlink("/etc/passwd", link)  # a name in /dev/shm that leads elsewhere
    try:
        for path in ("/etc/passwd", str(tmp_path / "x"), link, "/dev/shm/../etc/passwd"):
            with pytest.raises(ValueError, match="is not a file in /dev/shm"):
                receiver.lichen_receive_shm(json.dumps({**spec, "path": path}))
    finally:
        os.unlink(link)


def test_a_bucket_spec_past_its_bytes_or_with_an_unknown_dtype_is_refused():
    from lichen.engines.clients.vllm_worker_ext import _split

    flat = torch.zeros(16, dtype=torch.uint8)
    assert [t.shape for _, t in _split(flat, {"names": ["a"], "dtypes": ["float32"], "shapes": [[2, 2]]})] == [(2, 2)]
    with pytest.raises(ValueError, match="past the bucket's 16"):
        _split(flat, {"names": ["a", "b"], "dtypes": ["float32"] * 2, "shapes": [[2, 2], [1]]})
    with pytest.raises(ValueError, match="unknown dtype 'Tensor'"):
        _split(flat, {"names": ["a"], "dtypes": ["Tensor"], "shapes": [[1]]})
