"""Weight sync into real `lichen serve` processes: the broadcast (gloo), full and delta disk transports, the
weight endpoints, and the check that engines serve exactly the trainer's weights.

One module-scoped pair of servers (tied embeddings: the tiny model ties them). References are independent of the
code under test where it matters: tensors read back with /get_weights_by_name compared as exact floats, and
hashes recomputed here with xxhash over the tensors' bytes.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import xxhash
from helpers.serve_process import call as plain_call

from lichen.engines.clients.client import EngineError
from lichen.engines.clients.remote_engines import RemoteEngines
from lichen.engines.core.engine import Engine
from lichen.models import load_model
from lichen.sync.disk import FullDiskSync
from lichen.sync.disk_delta import DeltaSync
from lichen.sync.distributed import BroadcastSync, buckets
from lichen.sync.verify import WeightMismatchError, verify_engines, verify_in_process
from lichen.weights import VersionMismatchError, apply_delta_to_checkpoint, list_versions, read_version_info
from lichen.weights.hf_io import load_hf_state_dict

F32 = torch.float32
_ADMIN: dict[str, str] = {}


@pytest.fixture(autouse=True)
def _admin_key(request):
    """The pair's engines are keyed by their launcher; direct calls here carry its admin key."""
    if "pair" in request.fixturenames:
        _ADMIN["key"] = request.getfixturevalue("pair").launcher.admin_api_key


def call(url: str, body=None, **kwargs):
    return plain_call(url, body, headers={"Authorization": f"Bearer {_ADMIN['key']}"}, **kwargs)


def step(state: dict[str, torch.Tensor], seed: int, fraction: float = 0.02) -> dict[str, torch.Tensor]:
    """A sparse change like a small optimizer step: ~`fraction` of each tensor's elements move a little."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in state.items():
        mask = torch.rand(v.shape, generator=g) < fraction
        out[k] = v + mask * 1e-3 * torch.randn(v.shape, generator=g)
    return out


def served(pair: RemoteEngines, name: str) -> list[torch.Tensor]:
    """A parameter read back in full from each engine (independent of the checksum code)."""
    return [torch.tensor(x, dtype=F32) for x in pair.get_weights_by_name(name, 10_000)]


def checksums(pair: RemoteEngines) -> list[dict]:
    return pair.post_each("/weights_checker", {"action": "checksum"})


def pull(pair: RemoteEngines, local: str, source: str, version: int) -> list[dict]:
    return pair.post_each(
        "/pull_weights", {"local_checkpoint_dir": local, "source_dir": source, "target_version": version}
    )


def xxh(t: torch.Tensor) -> str:
    return xxhash.xxh3_128(t.contiguous().numpy().tobytes()).hexdigest()


def assert_served(pair: RemoteEngines, state: dict[str, torch.Tensor], version: int) -> None:
    assert pair.weight_versions() == [str(version)] * 2
    for body in checksums(pair):
        sums = body["ranks"][0]["checksums"]
        assert sums == {k: xxh(v) for k, v in state.items()}  # every tensor, bit for bit
    for got in served(pair, "model.embed_tokens.weight"):  # the tied embedding, read back as floats
        assert torch.equal(got, state["model.embed_tokens.weight"])


# ---- broadcast ----------------------------------------------------------------------------------------------
def test_broadcast_buckets_split_by_bytes():
    named = [("a", torch.zeros(10)), ("b", torch.zeros(30)), ("c", torch.zeros(5)), ("d", torch.zeros(1))]
    got = [[n for n, _ in b] for b in buckets(named, torch.bfloat16, 60)]  # bf16: 20, 60, 10, 2 bytes
    assert got == [["a"], ["b"], ["c", "d"]]
    assert all(t.dtype == torch.bfloat16 for b in buckets(named, torch.bfloat16, 60) for _, t in b)


@pytest.mark.slow
@pytest.mark.parametrize("flattened", [True, False], ids=["flattened_bucket", "tensor_by_tensor"])
def test_broadcast_syncs_are_bit_exact_and_reuse_the_group(pair, tiny_ckpt, flattened):
    """Both wire formats of /update_weights_from_distributed: one flattened uint8 tensor per bucket (load_format
    "flattened_bucket") and SGLang's default, one broadcast per tensor (load_format null)."""
    state = load_hf_state_dict(tiny_ckpt)
    bs = BroadcastSync(pair, buffer_size=60_000, group_name="t-broadcast", flattened=flattened)
    try:
        for version in (1, 2, 3):
            state = step(state, version)
            m = bs.push(iter(state.items()), version, F32)
            assert m["sync/buckets"] > 1 and m["sync/bytes"] == sum(v.numel() * 4 for v in state.values())
            assert_served(pair, state, version)
            assert verify_engines(pair, lambda: iter(state.items()), F32, version=version)[
                "sync/verified_tensors"
            ] == 2 * len(state)
        assert bs.groups_formed == 1
        verify_engines(pair, lambda: iter(state.items()), F32, method="sampled", full=True)
    finally:
        bs.close()
    st, body = call(pair.urls[0] + "/destroy_weights_update_group", {"group_name": "t-broadcast"})
    assert st == 400 and body["success"] is False  # already gone


def test_mis_mapped_tensor_name_fails_the_check(pair, tiny_ckpt):
    state = step(load_hf_state_dict(tiny_ckpt), 11)
    q, o = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    assert state[q].shape == state[o].shape
    sent = dict(state)
    sent[q], sent[o] = state[o], state[q]  # a wrong name mapping in the sender
    bs = BroadcastSync(pair, buffer_size=1 << 20, group_name="t-mismap")
    try:
        bs.push(iter(sent.items()), 7, F32)
    finally:
        bs.close()
    assert pair.weight_versions() == ["7", "7"]  # the version alone does not tell
    for method in ("checksum", "sampled"):
        with pytest.raises(WeightMismatchError) as info:
            verify_engines(pair, lambda: iter(state.items()), F32, version=7, method=method, full=True)
        msg = str(info.value)
        assert pair.urls[0] in msg and "version 7" in msg
        assert (q in msg and o in msg) if method == "checksum" else (q in msg or o in msg)  # sampled: first bad one


def test_in_process_check_names_the_tensor(tiny_ckpt):
    engine = Engine(load_model(tiny_ckpt), eos_token_ids=[0])  # no tokenizer needed here
    state = step(load_hf_state_dict(tiny_ckpt), 3)
    engine.update_weights_from_tensors(state.items(), "1")
    assert verify_in_process(engine, state.items(), 1) == len(state)
    bad = dict(state, **{"model.norm.weight": state["model.norm.weight"] + 1})
    with pytest.raises(WeightMismatchError, match="model.norm.weight"):
        verify_in_process(engine, bad.items(), 1)


# ---- disk: full and delta -------------------------------------------------------------------------------------
def _update(url: str, path: str, version: str) -> dict:
    st, body = call(url + "/update_weights_from_disk", {"model_path": path, "weight_version": version})
    assert st == 200, body
    return body


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_delta_sync_serves_what_full_sync_serves_and_applies_live(pair, tiny_ckpt, tmp_path, encoding):
    disk, local = str(tmp_path / "w"), str(tmp_path / "local")  # both engines share one local dir
    ds = DeltaSync(pair, disk_dir=disk, local_dir=local, hf_checkpoint=tiny_ckpt, encoding=encoding)
    state = load_hf_state_dict(tiny_ckpt)
    m0 = ds.push(iter(state.items()), 0, F32)  # version 0: seeds the local copy from the engines' checkpoint
    assert m0["sync/bytes"] == 0 and pair.weight_versions() == ["0", "0"]
    sizes = {}
    for version in (1, 2, 3):
        state = step(state, 100 + version)
        m = ds.push(iter(state.items()), version, F32)
        sizes[version] = m["sync/bytes"]
        assert m["sync/is_delta"] == (version > 1)
        assert_served(pair, state, version)
    assert sizes[2] < 0.3 * sizes[1] and sizes[3] < 0.3 * sizes[1]  # ~2% of the elements changed
    # the next version is pulled, then moved into the live weights by the delta (no reload)
    state = step(state, 104)
    ds.publisher.publish(state, 4)
    pulls = pull(pair, local, disk, 4)
    assert sorted(len(p["deltas_applied"]) for p in pulls) == [0, 1]  # one engine applied it, the other found it
    for url in pair.urls:
        assert "Applied deltas [4]" in _update(url, local, "4")["message"]
    assert_served(pair, state, 4)
    delta_sums = [b["per_engine_checksum"] for b in checksums(pair)]
    # the same weights through a full disk sync: the same served bytes
    FullDiskSync(pair, disk_dir=str(tmp_path / "full"), hf_checkpoint=tiny_ckpt).push(iter(state.items()), 5, F32)
    assert [b["per_engine_checksum"] for b in checksums(pair)] == delta_sums
    # a delta out of order is refused: version 4 builds on 3, the local copy holds 4
    with pytest.raises(VersionMismatchError):
        apply_delta_to_checkpoint(local, os.path.join(disk, "weight_v000004"))


def _flip_payload_byte(version_path: str) -> str:
    """Flip one byte inside the first tensor payload of a delta version; returns that tensor's name."""
    with open(os.path.join(version_path, "model.safetensors.index.json")) as f:
        name, fname = sorted(json.load(f)["weight_map"].items())[0]
    path = os.path.join(version_path, fname)
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        begin, end = json.loads(f.read(n))[name]["data_offsets"]
        f.seek(8 + n + (begin + end) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))
    return name


def test_corrupted_delta_fails_the_sync_and_engines_keep_serving(pair, tiny_ckpt, tmp_path, monkeypatch):
    disk, local = str(tmp_path / "w"), str(tmp_path / "local")
    ds = DeltaSync(pair, disk_dir=disk, local_dir=local, hf_checkpoint=tiny_ckpt)
    state = step(load_hf_state_dict(tiny_ckpt), 201)
    ds.push(iter(state.items()), 1, F32)
    good = state
    state = step(state, 202)
    publish = ds.publisher.publish

    def publish_then_corrupt(sd, version):
        res = publish(sd, version)
        publish_then_corrupt.name = _flip_payload_byte(res.path)
        return res

    monkeypatch.setattr(ds.publisher, "publish", publish_then_corrupt)
    with pytest.raises(EngineError) as info:
        ds.push(iter(state.items()), 2, F32)
    assert "/pull_weights" in str(info.value) and publish_then_corrupt.name in str(info.value)
    assert_served(pair, good, 1)  # still the last good version, and still generating
    assert len(pair.generate([_req()])) == 1
    monkeypatch.undo()
    m = ds.push(iter(state.items()), 3, F32)  # the failed sync reset the chain: a full version follows
    assert m["sync/is_delta"] == 0
    assert_served(pair, state, 3)


def _req():
    from lichen.engines.core.engine import GenRequest

    return GenRequest(input_ids=[3, 4, 5], max_new_tokens=3, temperature=0.0)


def test_late_joiner_seeds_from_newest_full_and_resume_starts_a_chain(pair, tiny_ckpt, tmp_path):
    disk, local = str(tmp_path / "w"), str(tmp_path / "local")
    ds = DeltaSync(pair, disk_dir=disk, local_dir=local, hf_checkpoint=tiny_ckpt)
    state = load_hf_state_dict(tiny_ckpt)
    for version in (1, 2, 3):
        state = step(state, 300 + version)
        ds.push(iter(state.items()), version, F32)
    # engine 0 "restarts": back on its base checkpoint, then joins with an empty local dir of its own
    url = pair.urls[0]
    _update(url, tiny_ckpt, "default")
    st, body = call(
        url + "/pull_weights", {"local_checkpoint_dir": str(tmp_path / "late"), "source_dir": disk, "target_version": 3}
    )
    assert st == 200 and "seeded from 1" in body["message"] and body["deltas_applied"] == [2, 3]
    assert "Applied deltas" not in _update(url, str(tmp_path / "late"), "3")["message"]  # a reload
    assert_served(pair, state, 3)
    # a resumed trainer: a new publisher starts a new chain with a full version, then deltas apply live again
    chain = read_version_info(os.path.join(disk, "weight_v000003")).chain_id
    resumed = DeltaSync(pair, disk_dir=disk, local_dir=local, hf_checkpoint=tiny_ckpt)
    state = step(state, 304)
    assert resumed.push(iter(state.items()), 4, F32)["sync/is_delta"] == 0
    assert read_version_info(os.path.join(disk, "weight_v000004")).chain_id != chain
    assert list_versions(disk) == [4]  # older versions than the newest full one are deleted
    state = step(state, 305)
    assert resumed.push(iter(state.items()), 5, F32)["sync/is_delta"] == 1
    assert_served(pair, state, 5)


def test_crash_before_rename_leaves_no_version(pair, tiny_ckpt, tmp_path, monkeypatch):
    import lichen.weights.versions as versions

    disk = str(tmp_path / "w")
    ds = DeltaSync(pair, disk_dir=disk, local_dir=str(tmp_path / "local"), hf_checkpoint=tiny_ckpt)
    state = step(load_hf_state_dict(tiny_ckpt), 401)
    real = os.rename

    def crash(src, dst):
        if os.path.basename(dst).startswith("weight_v"):
            raise OSError("simulated crash before the rename")
        return real(src, dst)

    monkeypatch.setattr(versions.os, "rename", crash)
    with pytest.raises(OSError, match="simulated crash"):
        ds.push(iter(state.items()), 1, F32)
    assert list_versions(disk) == [] and not [f for f in os.listdir(disk) if "weight_v" in f]
    monkeypatch.undo()
    ds.push(iter(state.items()), 1, F32)
    assert_served(pair, state, 1)


# ---- endpoints ------------------------------------------------------------------------------------------------
def test_weights_checker_snapshot_reset_compare(pair, tiny_ckpt):
    state = step(load_hf_state_dict(tiny_ckpt), 501)
    bs = BroadcastSync(pair, buffer_size=1 << 20, group_name="t-checker")
    try:
        bs.push(iter(state.items()), 1, F32)
        url = pair.urls[0] + "/weights_checker"
        assert call(url, {"action": "compare"})[0] == 400  # nothing to compare with yet
        assert call(url, {"action": "snapshot"})[0] == 200
        assert call(url, {"action": "reset_tensors"})[0] == 200
        st, body = call(url, {"action": "compare"})
        assert st == 400 and "model.embed_tokens.weight" in body["message"]
        bs.push(iter(state.items()), 2, F32)  # the update rewrites every tensor: equal to the snapshot again
        assert call(url, {"action": "compare"})[0] == 200
    finally:
        bs.close()
    st, body = call(url, method="GET")  # no body: checksum, in SGLang's shape
    assert st == 200 and body["ranks"][0]["parallelism_info"]["tp_size"] == 1
    assert len(body["per_engine_checksum"]) == 64 and body["checksum_format"] == "xxh3-128"
    assert call(url, {"action": "nope"})[0] == 400


def test_weight_endpoint_errors(pair, tmp_path):
    base = pair.urls[0]
    init = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
    st, body = call(base + "/init_weights_update_group", {**init, "backend": "nccl"})
    assert st == 400 and "use backend gloo" in body["message"]
    st, body = call(base + "/init_weights_update_group", {**init, "rank_offset": 0, "backend": "gloo"})
    assert st == 400 and "rank_offset" in body["message"]
    upd = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]], "group_name": "nope"}
    st, body = call(base + "/update_weights_from_distributed", upd)
    assert st == 400 and "/init_weights_update_group" in body["message"]
    st, body = call(base + "/update_weights_from_distributed", {**upd, "dtypes": ["float33"]})
    assert st == 400 and "float33" in body["message"]
    st, body = call(
        base + "/pull_weights",
        {"local_checkpoint_dir": str(tmp_path / "l"), "source_dir": str(tmp_path / "none"), "target_version": 2},
    )
    assert st == 400 and body["success"] is False and "does not exist" in body["message"]
    assert call(base + "/pull_weights", {"local_checkpoint_dir": "x", "source_dir": "y"})[0] == 400


def test_live_apply_falls_back_to_the_verified_local_copy(pair, tiny_ckpt, tmp_path):
    disk, local = str(tmp_path / "w"), str(tmp_path / "local")
    ds = DeltaSync(pair, disk_dir=disk, local_dir=local, hf_checkpoint=tiny_ckpt)
    state = load_hf_state_dict(tiny_ckpt)
    for version in (1, 2):
        state = step(state, 600 + version)
        ds.push(iter(state.items()), version, F32)
    state = step(state, 603)
    res = ds.publisher.publish(state, 3)
    pulls = pull(pair, local, disk, 3)  # the local copy is verified at version 3 ...
    _flip_payload_byte(res.path)  # ... then the published delta changes under the engines
    for url, p in zip(pair.urls, pulls):
        msg = _update(url, local, "3")["message"]
        if p["deltas_applied"] and os.environ.get("LICHEN_LIVE_STAGE", "1") != "0":
            # this engine decoded (and verified) the delta into its stage while pulling
            assert "Applied deltas [3]" in msg and "at pull time" in msg
        else:  # the other one decodes the published (now corrupt) delta at update time: it fails, so a reload
            assert "Applied deltas" not in msg
    assert_served(pair, state, 3)


def test_apply_delta_live_in_place_checks_order_and_checksums(tmp_path):
    from lichen.engines.server.weight_endpoints import apply_delta_live
    from lichen.weights import DeltaError, VersionPublisher

    g = torch.Generator().manual_seed(0)
    states = [{"a": torch.randn(64, 32, generator=g), "b": torch.randn(100, generator=g)}]
    for k in range(1, 3):
        states.append(step(states[-1], 700 + k, fraction=0.1))
    pub = VersionPublisher(str(tmp_path), encoding="overwrite")
    paths = [pub.publish(s, v + 1).path for v, s in enumerate(states)]
    chain = read_version_info(paths[0]).chain_id
    live = {k: v.clone() for k, v in states[0].items()}
    with pytest.raises(VersionMismatchError):
        apply_delta_live(live, paths[2], held_version=1, chain_id=chain)  # version 3 builds on 2
    assert apply_delta_live(live, paths[1], held_version=1, chain_id=chain) == 2
    assert all(torch.equal(live[k], states[1][k]) for k in live)
    name = _flip_payload_byte(paths[2])
    with pytest.raises(DeltaError, match=name):  # a checksum mismatch, or a payload that no longer decodes
        apply_delta_live(live, paths[2], held_version=2, chain_id=chain)


class FakeSGLang:
    """Engines that answer like SGLang: /weights_checker checksums the trainer cannot recompute, and
    /get_weights_by_name rows."""

    def __init__(self, weights: list[dict[str, torch.Tensor]], sums: list[str]):
        self.weights, self.sums = weights, sums

    def active_urls(self):
        return [f"http://e{i}" for i in range(len(self.weights))]

    def post_each(self, path, body):
        assert path == "/weights_checker" and body == {"action": "checksum"}
        info = {"tp_rank": 0, "tp_size": 1}
        return [
            {
                "success": True,
                "message": "",
                "per_engine_checksum": s,
                "ranks": [{"checksums": {}, "per_gpu_checksum": s, "parallelism_info": info}],
            }
            for s in self.sums
        ]

    def get_weights_by_name(self, name, truncate_size=100):
        return [w[name][:truncate_size].float().tolist() for w in self.weights]


def test_verify_against_servers_without_lichen_checksums():
    g = torch.Generator().manual_seed(1)
    state = {f"w{i}": torch.randn(5, 3, generator=g) for i in range(4)}
    ok = FakeSGLang([state, state], ["a", "a"])
    assert verify_engines(ok, lambda: iter(state.items()), F32)["sync/verified_tensors"] == 2 * 3  # 3 sampled
    assert verify_engines(ok, lambda: iter(state.items()), F32, full=True)["sync/verified_tensors"] == 2 * 4
    with pytest.raises(WeightMismatchError, match="http://e0 and http://e1 serve different weights"):
        verify_engines(FakeSGLang([state, state], ["a", "b"]), lambda: iter(state.items()), F32)
    bad = dict(state, w1=state["w1"] + 1e-3)  # not among the sampled first / middle / last: only full sees it
    assert verify_engines(FakeSGLang([state, bad], ["a", "a"]), lambda: iter(state.items()), F32)
    with pytest.raises(WeightMismatchError, match="http://e1 .* w1"):
        verify_engines(FakeSGLang([state, bad], ["a", "a"]), lambda: iter(state.items()), F32, full=True)
    bf16 = FakeSGLang([{k: v.to(torch.bfloat16) for k, v in state.items()}], ["a"])  # served in bf16
    verify_engines(bf16, lambda: iter(state.items()), torch.bfloat16, full=True)
    with pytest.raises(WeightMismatchError):
        verify_engines(bf16, lambda: iter(state.items()), F32, full=True)


def test_a_failing_engine_ends_the_wait_at_once(monkeypatch):
    """An engine that refuses a group or bucket never joins the collective: the trainer must not wait for it."""
    import asyncio
    import concurrent.futures
    import threading
    import time

    from lichen.sync.distributed import _while_engines_answer

    engines = RemoteEngines(["http://127.0.0.1:9", "http://127.0.0.1:10"])  # never contacted
    try:

        async def post_ok(c, path, body, timeout=None):
            if c.url.endswith(":9"):
                raise EngineError(f"{c.url}{path} answered HTTP 400: group does not exist")
            await asyncio.sleep(60)  # the other engine: blocked in the broadcast

        monkeypatch.setattr(engines, "_post_ok", post_ok)
        t0 = time.monotonic()
        pending = engines.post_each("/update_weights_from_distributed", {}, wait=False)
        with pytest.raises(EngineError, match="group does not exist"):
            _while_engines_answer(threading.Event().wait, pending, "test")  # a collective that never completes
        assert time.monotonic() - t0 < 10
    finally:
        engines.close()
    done = concurrent.futures.Future()
    done.set_result([{"success": True}])
    assert _while_engines_answer(lambda: 42, done, "test") == 42
