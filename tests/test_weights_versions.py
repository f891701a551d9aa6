"""Tests for lichen.weights.versions (publisher, on-disk format) and lichen.weights.pull (engine-side apply).

The format is checked against an independent reader written here from docs/weight-format.md#reader (struct + json +
zstandard + numpy + the hash libraries), so a version lichen publishes is one a stock SGLang pull could read.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import struct
import threading
import zlib

import blake3
import numpy as np
import pytest
import torch
import xxhash
import zstandard

from lichen.weights import (
    ChecksumMismatchError,
    DeltaError,
    VersionMismatchError,
    VersionPublisher,
    apply_delta_to_checkpoint,
    apply_delta_to_tensors,
    list_versions,
    load_hf_state_dict,
    newest_full_version,
    plan_pull,
    pull_weights,
    read_applied_version,
    read_version_info,
    version_dir,
)
from lichen.weights import delta_codec as D
from lichen_bench.codec import perturb

INDEX = "model.safetensors.index.json"


# ---------------------------------------------------------------- helpers


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(64, 16, generator=g) * 0.02
    sd = {"model.embed_tokens.weight": emb, "lm_head.weight": emb}  # tied: one tensor under two names
    for i in range(3):
        sd[f"model.layers.{i}.mlp.weight"] = torch.randn(16, 16, generator=g) * 0.02
    sd["model.norm.weight"] = torch.ones(16)
    sd["model.rope.positions"] = torch.arange(8)  # integer: keeps its dtype
    sd["model.scale"] = torch.tensor(0.5)  # 0-dim
    sd["model.empty"] = torch.zeros(0, 16)  # no bytes at all
    return sd


def _change(sd: dict[str, torch.Tensor], names: list[str], seed: int, frac: float = 0.1) -> None:
    """Move ~frac of the elements of each named tensor by 0.05 (always visible in bf16), in place."""
    g = torch.Generator().manual_seed(seed)
    for name in names:
        t = sd[name]
        mask = torch.rand(t.shape, generator=g) < frac
        mask.view(-1)[0] = True
        t[mask] += 0.05


def _engine(sd: dict[str, torch.Tensor], dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    return {k: (v.to(dtype) if v.is_floating_point() else v.clone()) for k, v in sd.items()}


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert _raw(got[k]) == _raw(want[k]), k


def _hash(fmt: str, data: bytes) -> str:
    if fmt == "xxh3-128":
        return xxhash.xxh3_128(data).hexdigest()
    if fmt == "blake3":
        return blake3.blake3(data).hexdigest()
    return f"{zlib.adler32(data):08x}"


def _header(path: str) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, json.loads(f.read(n))


def _locate(ckpt: str, name: str) -> tuple[str, int, int]:
    for path in glob.glob(os.path.join(ckpt, "*.safetensors")):
        n, h = _header(path)
        if name in h:
            b, e = h[name]["data_offsets"]
            return path, 8 + n + b, e - b
    raise KeyError(name)


def _flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x41]))


def _reference_pull(local: str, source: str, target: int) -> None:
    """docs/weight-format.md#reader written out plainly: seed from the newest full version, apply each delta
    (zstd, xor / overwrite), check each tensor against its shard's __metadata__ checksum. No lichen code."""
    start = target
    while "delta_encoding" in json.load(open(os.path.join(source, f"weight_v{start:06d}", INDEX)))["metadata"]:
        start -= 1
    shutil.copytree(os.path.join(source, f"weight_v{start:06d}"), local, dirs_exist_ok=True)
    for v in range(start + 1, target + 1):
        vdir = os.path.join(source, f"weight_v{v:06d}")
        index = json.load(open(os.path.join(vdir, INDEX)))
        meta = index["metadata"]
        assert int(meta["version"]) == v and int(meta["base_version"]) == v - 1
        assert meta["compression_format"] == "zstd"
        for fname in set(index["weight_map"].values()):
            n, h = _header(os.path.join(vdir, fname))
            blob = open(os.path.join(vdir, fname), "rb").read()
            for name, info in h.items():
                if name == "__metadata__":
                    continue
                b, e = info["data_offsets"]
                raw = zstandard.ZstdDecompressor().decompress(blob[8 + n + b : 8 + n + e])
                path, off, nbytes = _locate(local, name)
                with open(path, "r+b") as f:
                    f.seek(off)
                    old = bytearray(f.read(nbytes))
                    if meta["delta_encoding"] == "xor":
                        new = bytes(np.frombuffer(bytes(old), np.uint8) ^ np.frombuffer(raw, np.uint8))
                    else:
                        (count,) = struct.unpack_from("<I", raw)
                        for p, val in zip(struct.unpack_from(f"<{count}I", raw, 4), raw[4 + 4 * count :]):
                            old[p] = val
                        new = bytes(old)
                    assert _hash(meta["checksum_format"], new) == h["__metadata__"][name], name
                    f.seek(off)
                    f.write(new)


# ---------------------------------------------------------------- format


def test_full_then_delta_format(tmp_path):
    sd = _model()
    pub = VersionPublisher(str(tmp_path / "disk"), dtype=torch.bfloat16, checksum_format="blake3")
    r1 = pub.publish(sd, 1)
    v1 = version_dir(str(tmp_path / "disk"), 1)
    assert (r1.kind, r1.path, r1.base_version, r1.num_published) == ("full", v1, None, 9)
    index = json.load(open(os.path.join(v1, INDEX)))
    assert "delta_encoding" not in index["metadata"]
    assert index["metadata"]["version"] == "000001" and index["metadata"]["checksum_format"] == "blake3"
    _assert_same(load_hf_state_dict(v1), _engine(sd))  # an ordinary HF checkpoint in the engine dtype
    for name, fname in index["weight_map"].items():
        _, h = _header(os.path.join(v1, fname))
        assert h["__metadata__"]["format"] == "pt"
        assert h["__metadata__"][name] == _hash("blake3", _raw(_engine(sd)[name]))

    _change(sd, ["model.layers.1.mlp.weight", "model.norm.weight"], seed=1)
    r2 = pub.publish(sd, 2)
    v2 = version_dir(str(tmp_path / "disk"), 2)
    assert (r2.kind, r2.base_version, r2.num_published) == ("delta", 1, 2)
    index = json.load(open(os.path.join(v2, INDEX)))
    assert index["metadata"] == {
        "version": "000002",
        "base_version": "000001",
        "delta_encoding": "xor",
        "compression_format": "zstd",
        "checksum_format": "blake3",
        "chain_id": pub.chain_id,
    }
    assert sorted(index["weight_map"]) == ["model.layers.1.mlp.weight", "model.norm.weight"]
    for name, fname in index["weight_map"].items():
        n, h = _header(os.path.join(v2, fname))
        assert h[name]["dtype"] == "U8" and len(h[name]["shape"]) == 1
        assert h["__metadata__"][name] == _hash("blake3", _raw(_engine(sd)[name]))
    assert r2.wire_bytes == sum(os.path.getsize(os.path.join(v2, f)) for f in os.listdir(v2))
    assert r2.changed_bytes > 0 and r2.total_bytes == r1.total_bytes
    info = read_version_info(v2)
    assert info.is_delta and info.version == 2 and info.base_version == 1 and info.delta_encoding == "xor"


def test_tied_embedding_change_publishes_both_names(tmp_path):
    sd = _model()
    pub = VersionPublisher(str(tmp_path / "d"), dtype=torch.bfloat16)
    pub.publish(sd, 1)
    _change(sd, ["model.embed_tokens.weight"], seed=2)  # lm_head is the same tensor
    r = pub.publish(sd, 2)
    wm = json.load(open(os.path.join(r.path, INDEX)))["weight_map"]
    assert sorted(wm) == ["lm_head.weight", "model.embed_tokens.weight"] and r.num_published == 2


def test_unchanged_model_publishes_an_empty_delta(tmp_path):
    sd = _model()
    pub = VersionPublisher(str(tmp_path / "d"), dtype=torch.bfloat16)
    pub.publish(sd, 1)
    r = pub.publish(sd, 2)
    assert (r.kind, r.num_published, r.changed_bytes) == ("delta", 0, 0)
    assert json.load(open(os.path.join(r.path, INDEX)))["weight_map"] == {}
    assert not glob.glob(os.path.join(r.path, "*.safetensors"))
    local = str(tmp_path / "local")
    pull_weights(local, str(tmp_path / "d"), 1)
    res = pull_weights(local, str(tmp_path / "d"), 2)
    assert res.deltas_applied == [2] and read_applied_version(local) == 2
    _assert_same(load_hf_state_dict(local), _engine(sd))


# ---------------------------------------------------------------- chains


@pytest.mark.parametrize("encoding", D.ENCODINGS)
@pytest.mark.parametrize("fmt", D.CHECKSUM_FORMATS)
def test_chain_full_delta_delta_reconstructs_exactly(tmp_path, encoding, fmt):
    sd = _model()
    disk, local, ref = str(tmp_path / "d"), str(tmp_path / "local"), str(tmp_path / "ref")
    pub = VersionPublisher(disk, encoding=encoding, checksum_format=fmt, dtype=torch.bfloat16)
    for v, names in [
        (1, []),
        (2, ["model.layers.0.mlp.weight"]),
        (3, ["model.layers.2.mlp.weight", "model.embed_tokens.weight"]),
    ]:
        _change(sd, names, seed=v)
        assert pub.publish(sd, v).kind == ("full" if v == 1 else "delta")
        res = pull_weights(local, disk, v)
        assert res.version == v and read_applied_version(local) == v
        _assert_same(load_hf_state_dict(local), _engine(sd))
    _reference_pull(ref, disk, 3)  # an independent reader of the same files agrees
    _assert_same(load_hf_state_dict(ref), _engine(sd))


def test_float32_and_float16_engines(tmp_path):
    for dtype in (torch.float32, torch.float16):
        sd, disk, local = _model(), str(tmp_path / f"d{dtype}"), str(tmp_path / f"l{dtype}")
        pub = VersionPublisher(disk, dtype=dtype)
        pub.publish(sd, 1)
        _change(sd, ["model.layers.0.mlp.weight"], seed=4)
        pub.publish(sd, 2)
        pull_weights(local, disk, 2)
        _assert_same(load_hf_state_dict(local), _engine(sd, dtype))


def test_full_interval_and_deletion(tmp_path):
    sd = _model()
    disk, kept = str(tmp_path / "d"), str(tmp_path / "k")
    pub = VersionPublisher(disk, dtype=torch.bfloat16, full_interval=3)
    keep = VersionPublisher(kept, dtype=torch.bfloat16, full_interval=3, keep_files=True)
    kinds, present = [], []
    for v in range(1, 8):
        _change(sd, ["model.norm.weight"], seed=v)
        kinds.append(pub.publish(sd, v).kind[0])
        keep.publish(sd, v)
        present.append(list_versions(disk))
    assert kinds == ["f", "d", "d", "f", "d", "d", "f"]
    assert present == [[1], [1, 2], [1, 2, 3], [4], [4, 5], [4, 5, 6], [7]]
    assert list_versions(kept) == list(range(1, 8))
    assert newest_full_version(kept) == 7 and newest_full_version(kept, at_or_below=6) == 4


def test_only_first_is_full_by_default_and_gaps_force_full(tmp_path):
    sd, disk = _model(), str(tmp_path / "d")
    pub = VersionPublisher(disk, dtype=torch.bfloat16)
    kinds = [pub.publish(sd, v).kind for v in (1, 2, 3, 4)]
    assert kinds == ["full", "delta", "delta", "delta"]
    r = pub.publish(sd, 9)
    assert r.kind == "full" and "does not follow" in r.reason and list_versions(disk) == [9]
    with pytest.raises(ValueError, match="not after the last published version 9"):
        pub.publish(sd, 9)
    sd["model.norm.weight"] = torch.ones(17)
    assert pub.publish(sd, 10).reason == "tensor names, shapes or dtypes changed"


def test_mode_full_keeps_only_the_latest(tmp_path):
    sd, disk = _model(), str(tmp_path / "d")
    pub = VersionPublisher(disk, mode="full", dtype=torch.bfloat16)
    for v in (1, 2, 3):
        _change(sd, ["model.layers.0.mlp.weight"], seed=v)
        r = pub.publish(sd, v)
        assert r.kind == "full" and r.deleted == ([v - 1] if v > 1 else [])
    assert list_versions(disk) == [3]
    _assert_same(load_hf_state_dict(version_dir(disk, 3)), _engine(sd))


def test_many_shards_and_post_write_hook(tmp_path):
    sd, disk, local, ref = _model(), str(tmp_path / "d"), str(tmp_path / "local"), str(tmp_path / "ref")
    written = []
    pub = VersionPublisher(
        disk, dtype=torch.bfloat16, max_shard_bytes=100, post_write_hook=written.append, config={"model_type": "llama"}
    )
    pub.publish(sd, 1)
    shards = set(json.load(open(os.path.join(version_dir(disk, 1), INDEX)))["weight_map"].values())
    assert len(shards) >= 5 and json.load(open(os.path.join(version_dir(disk, 1), "config.json"))) == {
        "model_type": "llama"
    }
    _change(sd, ["model.layers.0.mlp.weight", "model.layers.1.mlp.weight", "model.layers.2.mlp.weight"], seed=3)
    pub.publish(sd, 2)
    assert len(set(json.load(open(os.path.join(version_dir(disk, 2), INDEX)))["weight_map"].values())) >= 2
    assert written == [version_dir(disk, 1), version_dir(disk, 2)]
    pull_weights(local, disk, 2)
    _reference_pull(ref, disk, 2)
    for d in (local, ref):
        _assert_same(load_hf_state_dict(d), _engine(sd))


def test_sparse_change_delta_is_much_smaller(tmp_path):
    g = torch.Generator().manual_seed(0)
    sd = {"w": (torch.randn(512, 1024, generator=g) * 0.02).to(torch.bfloat16)}
    pub = VersionPublisher(str(tmp_path / "d"))
    full = pub.publish(sd, 1)
    sd["w"] = perturb(sd["w"], 0.01, g)  # 1% of elements move by one ulp
    delta = pub.publish(sd, 2)
    print(
        f"\nfull version {full.wire_bytes} B, 1%-changed delta {delta.wire_bytes} B, "
        f"changed bytes {delta.changed_bytes}"
    )
    assert delta.wire_bytes < 0.04 * full.wire_bytes


# ---------------------------------------------------------------- failures


def test_base_version_mismatch_is_refused(tmp_path):
    sd, disk, local = _model(), str(tmp_path / "d"), str(tmp_path / "local")
    pub = VersionPublisher(disk, dtype=torch.bfloat16)
    for v in (1, 2, 3):
        _change(sd, ["model.norm.weight"], seed=v)
        pub.publish(sd, v)
    pull_weights(local, disk, 1)
    with pytest.raises(VersionMismatchError, match="builds on version 2, but .* holds version 1"):
        apply_delta_to_checkpoint(local, version_dir(disk, 3))
    assert read_applied_version(local) == 1  # refused before touching anything
    idx_path = os.path.join(version_dir(disk, 3), INDEX)
    index = json.load(open(idx_path))
    index["metadata"]["base_version"] = "000001"  # a delta that claims the wrong base
    json.dump(index, open(idx_path, "w"))
    with pytest.raises(VersionMismatchError, match="out-of-order delta"):
        pull_weights(local, disk, 3)
    assert read_applied_version(local) == 2


def test_corrupted_local_byte_is_detected_then_reseeded(tmp_path):
    sd, disk, local = _model(), str(tmp_path / "d"), str(tmp_path / "local")
    pub = VersionPublisher(disk, dtype=torch.bfloat16)
    pub.publish(sd, 1)
    pull_weights(local, disk, 1)
    path, off, _ = _locate(local, "model.layers.1.mlp.weight")
    _flip_byte(path, off + 10)
    _change(sd, ["model.layers.1.mlp.weight"], seed=5)
    pub.publish(sd, 2)
    with pytest.raises(ChecksumMismatchError) as e:
        pull_weights(local, disk, 2)
    assert "'model.layers.1.mlp.weight'" in str(e.value) and os.path.basename(path) in str(e.value)
    assert read_applied_version(local) is None  # no claim left behind
    res = pull_weights(local, disk, 2)  # reseeds from the full version and replays the delta
    assert res.seeded_from == 1 and res.deltas_applied == [2]
    _assert_same(load_hf_state_dict(local), _engine(sd))


def test_corrupted_delta_and_full_files_are_detected(tmp_path):
    sd, disk = _model(), str(tmp_path / "d")
    pub = VersionPublisher(disk, dtype=torch.bfloat16)
    pub.publish(sd, 1)
    _change(sd, ["model.layers.2.mlp.weight"], seed=6)
    pub.publish(sd, 2)
    local = str(tmp_path / "a")
    pull_weights(local, disk, 1)
    dpath, doff, dn = _locate(version_dir(disk, 2), "model.layers.2.mlp.weight")
    _flip_byte(dpath, doff + dn // 2)
    with pytest.raises(DeltaError) as e:
        pull_weights(local, disk, 2)
    assert "'model.layers.2.mlp.weight'" in str(e.value) and os.path.basename(dpath) in str(e.value)
    fpath, foff, _ = _locate(version_dir(disk, 1), "model.layers.0.mlp.weight")
    _flip_byte(fpath, foff + 3)
    with pytest.raises(ChecksumMismatchError, match="'model.layers.0.mlp.weight'") as e:
        pull_weights(str(tmp_path / "b"), disk, 1)
    assert os.path.basename(fpath) in str(e.value)
    assert read_applied_version(str(tmp_path / "b")) is None


def test_undecodable_delta_names_tensor_and_files(tmp_path, monkeypatch):
    import lichen.weights.pull as P

    sd, disk, local = _model(), str(tmp_path / "d"), str(tmp_path / "local")
    pub = VersionPublisher(disk, dtype=torch.bfloat16)
    pub.publish(sd, 1)
    pull_weights(local, disk, 1)
    _change(sd, ["model.layers.0.mlp.weight", "model.norm.weight"], seed=2)
    pub.publish(sd, 2)
    real = P.apply_tensor_at

    def broken(encoding, payload, fd, offset, nbytes, **kw):  # one payload fails to decode (a bad frame, ...)
        if nbytes == 16 * 2:
            raise DeltaError("payload decodes to 7 bytes")
        return real(encoding, payload, fd, offset, nbytes, **kw)

    monkeypatch.setattr(P, "apply_tensor_at", broken)
    with pytest.raises(
        DeltaError,
        match=r"tensor 'model.norm.weight' in .*weight_v000002/model-00001-of-00001"
        r".safetensors \(applying to .*local/model-00001-of-00001.safetensors\): "
        r"payload decodes to 7 bytes",
    ):
        pull_weights(local, disk, 2)
    assert read_applied_version(local) is None
    monkeypatch.setattr(P, "apply_tensor_at", real)
    assert pull_weights(local, disk, 2).seeded_from == 1
    _assert_same(load_hf_state_dict(local), _engine(sd))


def test_crash_before_rename_leaves_no_version(tmp_path, monkeypatch):
    sd, disk = _model(), str(tmp_path / "d")
    pub = VersionPublisher(disk, dtype=torch.bfloat16)
    pub.publish(sd, 1)
    real_rename = os.rename

    def crash(src, dst):
        if os.path.basename(dst) == "weight_v000002":
            raise OSError("simulated crash before the rename")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", crash)
    _change(sd, ["model.norm.weight"], seed=7)
    with pytest.raises(OSError, match="simulated crash"):
        pub.publish(sd, 2)
    monkeypatch.setattr(os, "rename", real_rename)
    assert list_versions(disk) == [1] and sorted(os.listdir(disk)) == ["weight_v000001"]
    assert pub.publish(sd, 2).kind == "full"  # the snapshot may have advanced: start a new chain
    # a half-written version of a crashed process is invisible and removed by the next chain start
    os.makedirs(os.path.join(disk, ".weight_v000003.tmp-99999"))
    open(os.path.join(disk, ".weight_v000003.tmp-99999", "model-00001-of-00001.safetensors"), "wb").close()
    assert list_versions(disk) == [2]
    with pytest.raises(FileNotFoundError, match="weight_v000003"):
        pull_weights(str(tmp_path / "l"), disk, 3)
    VersionPublisher(disk, dtype=torch.bfloat16).publish(sd, 3)
    assert sorted(os.listdir(disk)) == ["weight_v000003"]


# ---------------------------------------------------------------- engines joining, resuming, sharing


def test_late_joiner_seeds_from_newest_full(tmp_path):
    sd, disk = _model(), str(tmp_path / "d")
    pub = VersionPublisher(disk, dtype=torch.bfloat16, full_interval=3)
    early = str(tmp_path / "early")
    for v in range(1, 6):  # F D D F D
        _change(sd, ["model.layers.0.mlp.weight"], seed=v)
        pub.publish(sd, v)
        if v == 2:
            pull_weights(early, disk, 2)
        if v == 4:
            assert plan_pull(disk, 4, 2) == (4, [])
    late = pull_weights(str(tmp_path / "late"), disk, 5)
    assert (late.seeded_from, late.deltas_applied) == (4, [5])
    back = pull_weights(early, disk, 5)  # its deltas 3 were deleted: it reseeds from 4
    assert (back.seeded_from, back.deltas_applied) == (4, [5])
    for d in ("late", "early"):
        _assert_same(load_hf_state_dict(str(tmp_path / d)), _engine(sd))


def test_resume_starts_a_new_chain(tmp_path):
    sd, disk, local = _model(), str(tmp_path / "d"), str(tmp_path / "local")
    old = VersionPublisher(disk, dtype=torch.bfloat16)
    for v in range(1, 6):
        _change(sd, ["model.norm.weight"], seed=v)
        old.publish(sd, v)
    pull_weights(local, disk, 5)
    resumed = _model(seed=1)  # a resumed trainer republishes from version 3 with other weights
    new = VersionPublisher(disk, dtype=torch.bfloat16)
    r = new.publish(resumed, 3)
    assert r.kind == "full" and list_versions(disk) == [3] and r.deleted == [1, 2, 4, 5]  # stale and old
    res = pull_weights(local, disk, 3)
    assert res.seeded_from == 3
    _assert_same(load_hf_state_dict(local), _engine(resumed))
    # same version number, different chain: the local copy is not trusted
    other = VersionPublisher(disk, dtype=torch.bfloat16)
    resumed2 = _model(seed=2)
    other.publish(resumed2, 3)
    res = pull_weights(local, disk, 3)
    assert res.seeded_from == 3 and not res.noop
    _assert_same(load_hf_state_dict(local), _engine(resumed2))
    _change(resumed2, ["model.layers.0.mlp.weight"], seed=9)
    other.publish(resumed2, 4)
    assert pull_weights(local, disk, 4).deltas_applied == [4]
    _assert_same(load_hf_state_dict(local), _engine(resumed2))


def test_two_engines_share_one_local_dir(tmp_path):
    sd, disk, local = _model(), str(tmp_path / "d"), str(tmp_path / "local")
    pub = VersionPublisher(disk, dtype=torch.bfloat16)
    pub.publish(sd, 1)
    _change(sd, ["model.layers.1.mlp.weight"], seed=3)
    pub.publish(sd, 2)
    results, errors = [], []
    start = threading.Barrier(2)

    def engine():
        try:
            start.wait()
            results.append(pull_weights(local, disk, 2))
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=engine) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(r.noop for r in results) == [False, True]  # the second found the work done
    assert read_applied_version(local) == 2
    _assert_same(load_hf_state_dict(local), _engine(sd))


def test_target_zero_resets_to_the_base_checkpoint(tmp_path):
    sd, disk, local, base = _model(), str(tmp_path / "d"), str(tmp_path / "local"), str(tmp_path / "base")
    VersionPublisher(base, mode="full", dtype=torch.bfloat16).publish(sd, 1)
    base = version_dir(base, 1)
    pub = VersionPublisher(disk, dtype=torch.bfloat16)
    _change(sd, ["model.norm.weight"], seed=1)
    pub.publish(sd, 1)
    pull_weights(local, disk, 1)
    res = pull_weights(local, disk, 0, base_dir=base)
    assert res.seeded_from == 0 and read_applied_version(local) == 0
    _assert_same(load_hf_state_dict(local), load_hf_state_dict(base))
    with pytest.raises(DeltaError, match="no base checkpoint"):
        pull_weights(str(tmp_path / "fresh"), disk, 0)


# ---------------------------------------------------------------- live tensors


@pytest.mark.parametrize("encoding", D.ENCODINGS)
def test_apply_delta_to_live_tensors(tmp_path, encoding):
    sd, disk = _model(), str(tmp_path / "d")
    pub = VersionPublisher(disk, dtype=torch.bfloat16, encoding=encoding)
    pub.publish(sd, 1)
    live = load_hf_state_dict(version_dir(disk, 1))
    name = "model.layers.0.mlp.weight"
    _change(sd, [name, "model.embed_tokens.weight"], seed=8)
    pub.publish(sd, 2)
    with pytest.raises(VersionMismatchError, match="builds on version 1, but the engine holds 0"):
        apply_delta_to_tensors(live, version_dir(disk, 2), held_version=0)
    wrong = {k: v.clone() for k, v in live.items()}
    same = (live[name] == _engine(sd)[name]).view(-1).nonzero()[0, 0]  # an element this delta leaves alone
    wrong[name].view(-1)[same] += 1.0  # so these are not the bytes the delta was made against
    before = {k: v.clone() for k, v in wrong.items()}
    with pytest.raises(ChecksumMismatchError, match=name):
        apply_delta_to_tensors(wrong, version_dir(disk, 2), held_version=1)
    _assert_same(wrong, before)  # nothing was written
    assert apply_delta_to_tensors(live, version_dir(disk, 2), held_version=1, held_chain_id=pub.chain_id) == 3
    _assert_same(live, _engine(sd))
