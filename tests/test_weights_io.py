"""Tests for lichen.weights.hf_io: HF safetensors save/load, sharding, dtype cast, shared storage, atomicity."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch

from lichen.weights import load_hf_metadata, load_hf_state_dict, safetensors_files, save_hf_checkpoint

_NP_VIEW = {
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.bfloat16: np.uint16,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.bool: np.bool_,
}
_ST_DTYPE = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.bool: "BOOL",
}


def _raw_bytes(t: torch.Tensor) -> bytes:
    """Little-endian bytes of a tensor, computed without safetensors (bf16 viewed as int16)."""
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def _assert_bit_exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(sorted(a)) == list(sorted(b))
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        assert _raw_bytes(a[k]) == _raw_bytes(b[k]), k


def _mixed_state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    f32 = torch.randn(5, 3, generator=g)
    f32[0, 0] = float("nan")  # NaN payloads must survive bit-exactly too
    f32[0, 1] = float("-inf")
    return {
        "model.embed_tokens.weight": f32,
        "model.layers.0.mlp.weight": torch.randn(4, 6, generator=g).to(torch.bfloat16),
        "model.layers.0.norm.weight": torch.randn(7, generator=g).to(torch.float16),
        "model.layers.0.attn.weight_t": torch.randn(6, 4, generator=g).t(),  # non-contiguous view
        "step_counter": torch.tensor([3, -2, 1 << 40], dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }


def _parse_header(path: str) -> tuple[dict, int]:
    """Independent reader of the safetensors format: u64 LE header length, JSON header, then the data block."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def test_unsharded_round_trip_bit_exact_and_file_format(tmp_path):
    sd = _mixed_state_dict()
    out = tmp_path / "ckpt"
    save_hf_checkpoint(sd, str(out), metadata={"weight_version": 3, "note": "hi"})
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    _assert_bit_exact(sd, load_hf_state_dict(str(out)))

    # Check the bytes on disk with a hand-written parser, not safetensors itself.
    header, data_start = _parse_header(str(out / "model.safetensors"))
    assert header.pop("__metadata__") == {"format": "pt", "weight_version": "3", "note": "hi"}
    blob = (out / "model.safetensors").read_bytes()[data_start:]
    for name, t in sd.items():
        entry = header[name]
        assert entry["dtype"] == _ST_DTYPE[t.dtype]
        assert entry["shape"] == list(t.shape)
        lo, hi = entry["data_offsets"]
        assert blob[lo:hi] == _raw_bytes(t)
    assert load_hf_metadata(str(out))["weight_version"] == "3"


def _expected_shards(sizes: list[int], cap: int) -> list[list[int]]:
    shards, cur, used = [], [], 0
    for i, s in enumerate(sizes):
        if cur and used + s > cap:
            shards.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += s
    shards.append(cur)
    return shards


def test_sharded_round_trip_index_and_placement(tmp_path):
    sd = _mixed_state_dict()
    cap = 64
    names = list(sd)
    sizes = [t.numel() * t.element_size() for t in sd.values()]
    assert sizes == [60, 48, 14, 96, 24, 3]
    expected = _expected_shards(sizes, cap)
    assert expected == [[0], [1, 2], [3], [4, 5]]  # hand check of the greedy reference

    out = tmp_path / "sharded"
    save_hf_checkpoint(sd, str(out), max_shard_bytes=cap, metadata={"weight_version": 7})
    n = len(expected)
    shard_names = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(os.listdir(out)) == sorted(shard_names + ["model.safetensors.index.json"])

    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": sum(sizes), "weight_version": 7}
    assert index["weight_map"] == {names[i]: shard_names[s] for s, idx in enumerate(expected) for i in idx}
    for s, idx in enumerate(expected):  # each shard holds exactly the names the index says
        with safetensors.safe_open(str(out / shard_names[s]), framework="pt") as f:
            assert sorted(f.keys()) == sorted(names[i] for i in idx)
            assert f.metadata()["format"] == "pt"

    assert safetensors_files(str(out)) == [str(out / s) for s in shard_names]
    _assert_bit_exact(sd, load_hf_state_dict(str(out)))


def test_shard_plan_hand_checked(tmp_path):
    # sizes 40, 40, 100, 12, 12, 12 bytes with cap 64 -> [40] [40] [100] [12, 12, 12]
    sd = {f"t{i}": torch.zeros(n // 4, dtype=torch.float32) + i for i, n in enumerate([40, 40, 100, 12, 12, 12])}
    save_hf_checkpoint(sd, str(tmp_path / "c"), max_shard_bytes=64)
    index = json.loads((tmp_path / "c" / "model.safetensors.index.json").read_text())
    shard_of = {k: int(v.split("-")[1]) for k, v in index["weight_map"].items()}
    assert shard_of == {"t0": 1, "t1": 2, "t2": 3, "t3": 4, "t4": 4, "t5": 4}
    assert all(v.endswith("-of-00004.safetensors") for v in index["weight_map"].values())


def test_fits_exactly_in_one_shard_is_unsharded(tmp_path):
    sd = {"a": torch.ones(4), "b": torch.ones(4)}  # 32 bytes
    save_hf_checkpoint(sd, str(tmp_path / "c"), max_shard_bytes=32)
    assert os.listdir(tmp_path / "c") == ["model.safetensors"]


def test_dtype_cast_on_save_and_load(tmp_path):
    sd = {"w": torch.randn(8, 8, generator=torch.Generator().manual_seed(1)), "ids": torch.arange(5)}
    save_hf_checkpoint(sd, str(tmp_path / "c"), dtype=torch.bfloat16)
    loaded = load_hf_state_dict(str(tmp_path / "c"))
    assert loaded["w"].dtype == torch.bfloat16
    assert _raw_bytes(loaded["w"]) == _raw_bytes(sd["w"].to(torch.bfloat16))
    assert loaded["ids"].dtype == torch.int64 and torch.equal(loaded["ids"], sd["ids"])

    up = load_hf_state_dict(str(tmp_path / "c"), dtype=torch.float64)
    assert up["w"].dtype == torch.float64 and torch.equal(up["w"], sd["w"].to(torch.bfloat16).double())
    assert up["ids"].dtype == torch.int64


def test_dtype_cast_sizes_the_shards(tmp_path):
    # 4 tensors of 16 fp32 values = 64 bytes each; cast to bf16 they are 32 bytes -> two per 64-byte shard.
    sd = {f"t{i}": torch.full((16,), float(i)) for i in range(4)}
    save_hf_checkpoint(sd, str(tmp_path / "c"), max_shard_bytes=64, dtype=torch.float16)
    index = json.loads((tmp_path / "c" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 4 * 32
    assert len(set(index["weight_map"].values())) == 2


@pytest.mark.parametrize("cap", [5 * 1024**3, 40])
def test_tied_and_shared_storage_weights(tmp_path, cap):
    emb = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    buf = torch.arange(12, dtype=torch.float32)
    sd = {
        "embed.weight": emb,
        "lm_head.weight": emb,  # tied: same tensor object
        "a": buf[:6],
        "b": buf[6:],
        "c": buf.view(3, 4),
    }  # views of one storage
    save_hf_checkpoint(sd, str(tmp_path / "c"), max_shard_bytes=cap)
    loaded = load_hf_state_dict(str(tmp_path / "c"))
    _assert_bit_exact({k: v.contiguous() for k, v in sd.items()}, loaded)
    loaded["embed.weight"][0, 0] = 123.0  # loaded tensors are independent
    assert loaded["lm_head.weight"][0, 0] != 123.0
    assert emb[0, 0] != 123.0  # and saving did not touch the caller's tensors


def test_copy_files_and_config(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    keep = [
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
        "chat_template.jinja",
        "vocab.json",
        "merges.txt",
    ]
    drop = [
        "model.safetensors",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
        "pytorch_model.bin.index.json",
        ".gitattributes",
    ]
    for name in keep + drop:
        (src / name).write_text(f"content of {name}")
    (src / "config.json").write_text(json.dumps({"model_type": "old"}))
    (src / "subdir").mkdir()

    sd = {"w": torch.ones(2)}
    save_hf_checkpoint(
        sd, str(tmp_path / "a"), config={"model_type": "llama", "hidden_size": 8}, copy_files_from=str(src)
    )
    assert sorted(os.listdir(tmp_path / "a")) == sorted(keep + ["config.json", "model.safetensors"])
    for name in keep:
        assert (tmp_path / "a" / name).read_text() == f"content of {name}"
    assert json.loads((tmp_path / "a" / "config.json").read_text()) == {"model_type": "llama", "hidden_size": 8}

    # Without a config, the source's config.json is carried over.
    save_hf_checkpoint(sd, str(tmp_path / "b"), copy_files_from=str(src))
    assert json.loads((tmp_path / "b" / "config.json").read_text()) == {"model_type": "old"}

    with pytest.raises(FileNotFoundError, match="nope"):
        save_hf_checkpoint(sd, str(tmp_path / "c"), copy_files_from=str(tmp_path / "nope"))
    assert not (tmp_path / "c").exists()


def test_replace_existing_checkpoint_cleanly(tmp_path):
    out = tmp_path / "ckpt"
    v1 = {f"t{i}": torch.full((16,), float(i)) for i in range(4)}
    save_hf_checkpoint(v1, str(out), max_shard_bytes=64)  # sharded
    v2 = {"t0": torch.full((3,), 9.0)}
    save_hf_checkpoint(v2, str(out))  # unsharded replaces it: no stale shards or index left
    assert os.listdir(out) == ["model.safetensors"]
    _assert_bit_exact(v2, load_hf_state_dict(str(out)))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no .tmp-/.old- siblings


def test_failed_write_keeps_old_checkpoint(tmp_path, monkeypatch):
    out = tmp_path / "ckpt"
    v1 = {"w": torch.randn(4, 4, generator=torch.Generator().manual_seed(3))}
    save_hf_checkpoint(v1, str(out), config={"v": 1})

    real_save = safetensors.torch.save_file
    calls = []

    def flaky_save(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) > 1:
            raise OSError("disk full (simulated)")
        return real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", flaky_save)
    v2 = {f"t{i}": torch.full((16,), float(i)) for i in range(4)}
    with pytest.raises(OSError, match="disk full"):
        save_hf_checkpoint(v2, str(out), max_shard_bytes=64, config={"v": 2})
    assert len(calls) == 2  # the first shard was really written before the failure
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text()) == {"v": 1}
    _assert_bit_exact(v1, load_hf_state_dict(str(out)))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # temp directory removed


def test_stale_tmp_dir_from_same_pid_is_replaced(tmp_path):
    out = tmp_path / "ckpt"
    stale = tmp_path / f"ckpt.tmp-{os.getpid()}"
    stale.mkdir()
    (stale / "model-00001-of-00009.safetensors").write_text("junk")
    save_hf_checkpoint({"w": torch.ones(1)}, str(out))
    assert os.listdir(out) == ["model.safetensors"]
    assert not stale.exists()


def test_load_errors_name_the_directory(tmp_path):
    missing = tmp_path / "does-not-exist"
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_hf_state_dict(str(missing))
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        safetensors_files(str(missing))

    empty = tmp_path / "empty"
    empty.mkdir()
    assert safetensors_files(str(empty)) == []
    with pytest.raises(FileNotFoundError, match="empty"):
        load_hf_state_dict(str(empty))

    binonly = tmp_path / "binonly"
    binonly.mkdir()
    (binonly / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="convert them to safetensors"):
        load_hf_state_dict(str(binonly))

    broken = tmp_path / "broken"
    save_hf_checkpoint({f"t{i}": torch.ones(16) for i in range(3)}, str(broken), max_shard_bytes=64)
    os.remove(broken / "model-00002-of-00003.safetensors")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00003"):
        load_hf_state_dict(str(broken))


def test_bad_inputs(tmp_path):
    with pytest.raises(TypeError, match="'w'"):
        save_hf_checkpoint({"w": [1.0, 2.0]}, str(tmp_path / "c"))
    with pytest.raises(ValueError, match="max_shard_bytes"):
        save_hf_checkpoint({"w": torch.ones(1)}, str(tmp_path / "c"), max_shard_bytes=0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        save_hf_checkpoint({"w": torch.ones(1)}, str(tmp_path / "file"))
    assert not (tmp_path / "c").exists()


def test_weights_package_is_a_leaf():
    import ast

    import lichen.weights.hf_io as mod

    tree = ast.parse(open(mod.__file__, encoding="utf-8").read())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert "lichen" not in imported
    assert imported <= {"__future__", "json", "os", "shutil", "safetensors", "torch", "typing"}
