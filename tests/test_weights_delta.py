"""Tests for lichen.weights.delta_codec: the xor / overwrite payloads, zstd framing, checksums, and the
delta benchmark (lichen_bench.codec).

References are independent of the codec: payload contents are rebuilt with struct / plain numpy, checksums
are checked against published test vectors, expected bytes come from numpy integer views of the tensors.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch
import zstandard

from lichen.weights import (
    DeltaError,
    apply_tensor,
    checksum,
    decode_tensor,
    encode_tensor,
    new_hasher,
    tensor_bytes,
)
from lichen.weights import delta_codec as D
from lichen_bench.codec import bench_delta, perturb

_INT_VIEW_T = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _np_bytes(t: torch.Tensor) -> np.ndarray:
    """Little-endian bytes of a float tensor via its integer view (no use of tensor_bytes)."""
    ints = t.contiguous().view(_INT_VIEW_T[t.dtype]).numpy()
    return np.frombuffer(ints.astype(ints.dtype.newbyteorder("<")).tobytes(), dtype=np.uint8).copy()


def _old_new(dtype: torch.dtype, n: int = 5000, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = (torch.randn(n, generator=g) * 0.02).to(dtype)
    new = old.clone()
    idx = torch.randperm(n, generator=g)[: n // 20]
    new[idx[: len(idx) // 2]] = torch.randn(len(idx) // 2, generator=g).to(dtype)  # arbitrary new values
    ints = new.view(_INT_VIEW_T[dtype])
    ints[idx[len(idx) // 2 :]] ^= 1  # one-ulp moves
    return old, new


# ---------------------------------------------------------------- checksums


@pytest.mark.parametrize(
    "fmt,data,want",
    [
        ("blake3", b"", "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"),
        ("blake3", b"abc", "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85"),
        ("xxh3-128", b"", "99aa06d3014798d86001c324468d497f"),
        ("adler32", b"Wikipedia", "11e60398"),
        ("adler32", b"", "00000001"),
    ],
)
def test_checksum_known_vectors(fmt, data, want):
    assert checksum(fmt, data) == want
    assert checksum(fmt, np.frombuffer(data, dtype=np.uint8)) == want


@pytest.mark.parametrize("fmt", D.CHECKSUM_FORMATS)
def test_incremental_hash_equals_one_shot(fmt):
    data = np.random.default_rng(0).integers(0, 256, 10_001, dtype=np.uint8)
    h = new_hasher(fmt)
    for s in range(0, data.size, 999):
        h.update(data[s : s + 999])
    assert h.hexdigest() == checksum(fmt, data.tobytes())


def test_unknown_formats_rejected():
    with pytest.raises(ValueError, match="checksum format 'md5'"):
        checksum("md5", b"")
    with pytest.raises(ValueError, match="delta encoding 'diff'"):
        encode_tensor("diff", np.zeros(4, np.uint8), np.zeros(4, np.uint8))


# ---------------------------------------------------------------- payload formats


def test_xor_payload_is_zstd_of_new_xor_old():
    old = np.array([0, 1, 2, 3, 250, 5, 6, 7], dtype=np.uint8)
    new = np.array([0, 1, 9, 3, 250, 5, 6, 200], dtype=np.uint8)
    enc = encode_tensor("xor", new, old, checksum_format="adler32")
    want = bytes(a ^ b for a, b in zip(new.tolist(), old.tolist()))
    assert zstandard.ZstdDecompressor().decompress(enc.payload) == want
    assert zstandard.get_frame_parameters(enc.payload).content_size == 8
    assert enc.changed_bytes == 2
    assert enc.checksum == f"{zlib.adler32(new.tobytes()):08x}"


def test_overwrite_payload_layout():
    old = np.arange(10, dtype=np.uint8)
    new = old.copy()
    new[2], new[7] = 99, 0
    enc = encode_tensor("overwrite", new, old)
    raw = zstandard.ZstdDecompressor().decompress(enc.payload)
    assert raw == struct.pack("<I", 2) + struct.pack("<2I", 2, 7) + bytes([99, 0])
    assert enc.changed_bytes == 2 and enc.checksum is None


def test_unchanged_tensor_encodes_to_none():
    a = np.random.default_rng(1).integers(0, 256, 300, dtype=np.uint8)
    for enc in D.ENCODINGS:
        assert encode_tensor(enc, a, a.copy()) is None


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("encoding", D.ENCODINGS)
@pytest.mark.parametrize("chunk", [D.CHUNK_BYTES, 1000])
def test_round_trip_bit_exact(dtype, encoding, chunk, monkeypatch):
    monkeypatch.setattr(D, "CHUNK_BYTES", chunk)  # 1000: many chunks, one not a multiple of the element size
    old, new = _old_new(dtype)
    old_b, new_b = _np_bytes(old), _np_bytes(new)
    snapshot = old_b.copy()
    enc = encode_tensor(encoding, tensor_bytes(new), snapshot, checksum_format="xxh3-128", update_old=True)
    assert np.array_equal(snapshot, new_b)  # the snapshot moved to the new bytes
    assert enc.changed_bytes == int(np.count_nonzero(old_b != new_b))
    assert enc.checksum == checksum("xxh3-128", new_b.tobytes())
    out, digest = decode_tensor(encoding, enc.payload, old_b, checksum_format="xxh3-128")
    assert np.array_equal(out, new_b) and digest == enc.checksum
    assert np.array_equal(old_b, _np_bytes(old))  # decode leaves its input alone
    # in place into a live tensor's memory
    live = old.clone()
    apply_tensor(encoding, enc.payload, tensor_bytes(live))
    assert torch.equal(live.view(_INT_VIEW_T[dtype]), new.view(_INT_VIEW_T[dtype]))


def test_xor_twice_is_not_once_and_overwrite_is_idempotent():
    old, new = _old_new(torch.bfloat16)
    old_b, new_b = _np_bytes(old), _np_bytes(new)
    xor = encode_tensor("xor", new_b, old_b).payload
    target = old_b.copy()
    apply_tensor("xor", xor, target)
    assert np.array_equal(target, new_b)
    apply_tensor("xor", xor, target)
    assert not np.array_equal(target, new_b) and np.array_equal(target, old_b)  # XOR undoes itself
    ow = encode_tensor("overwrite", new_b, old_b).payload
    target = old_b.copy()
    for _ in range(3):
        apply_tensor("overwrite", ow, target)
        assert np.array_equal(target, new_b)


def test_tensor_bytes_shares_memory_and_handles_scalars():
    t = torch.zeros(3, dtype=torch.float32)
    tensor_bytes(t)[0:4] = np.frombuffer(struct.pack("<f", 1.5), dtype=np.uint8)
    assert t[0].item() == 1.5
    s = torch.tensor(2.0, dtype=torch.bfloat16)
    assert tensor_bytes(s).tolist() == list(struct.pack("<H", 0x4000))


# ---------------------------------------------------------------- bad payloads


def test_bad_payloads_raise():
    old, new = np.zeros(100, np.uint8), np.ones(100, np.uint8)
    xor = encode_tensor("xor", new, old).payload
    with pytest.raises(DeltaError, match="decodes to 100 bytes but the tensor holds 50"):
        apply_tensor("xor", xor, np.zeros(50, np.uint8))
    with pytest.raises(DeltaError):
        apply_tensor("xor", b"not a zstd frame", np.zeros(100, np.uint8))
    with pytest.raises(DeltaError):
        apply_tensor("xor", xor[:-3], np.zeros(100, np.uint8))
    ow = zstandard.ZstdCompressor().compress(struct.pack("<II", 1, 500) + b"\x07")
    with pytest.raises(DeltaError, match="offset 500 is outside the 100-byte tensor"):
        apply_tensor("overwrite", ow, np.zeros(100, np.uint8))
    short = zstandard.ZstdCompressor().compress(struct.pack("<II", 3, 1))
    with pytest.raises(DeltaError, match="count 3 needs 19"):
        apply_tensor("overwrite", short, np.zeros(100, np.uint8))


def test_corrupted_payload_byte_is_caught_by_checksum_or_frame():
    old, new = _old_new(torch.bfloat16, n=20_000)
    old_b, new_b = _np_bytes(old), _np_bytes(new)
    enc = encode_tensor("xor", new_b, old_b, checksum_format="blake3")
    bad = bytearray(enc.payload)
    bad[len(bad) // 2] ^= 0x10
    try:
        _, digest = decode_tensor("xor", bytes(bad), old_b, checksum_format="blake3")
    except DeltaError:
        return
    assert digest != enc.checksum


# ---------------------------------------------------------------- size and benchmark


def test_compression_shrinks_a_sparse_change():
    g = torch.Generator().manual_seed(3)
    old = (torch.randn(1 << 20, generator=g) * 0.02).to(torch.bfloat16)
    new = perturb(old, 0.01, g)
    full = old.numel() * old.element_size()
    sizes = {enc: len(encode_tensor(enc, _np_bytes(new), _np_bytes(old)).payload) for enc in D.ENCODINGS}
    print(f"\n1%-changed bf16 tensor: full {full} B, xor {sizes['xor']} B, overwrite {sizes['overwrite']} B")
    assert sizes["xor"] < 0.04 * full
    assert sizes["overwrite"] < 0.1 * full


@pytest.mark.parametrize("encoding", D.ENCODINGS)
def test_bench_delta_reports_sizes_and_times(encoding):
    r = bench_delta(300_000, 0.02, encoding=encoding, tensor_params=100_000, num_threads=2)
    print("\n", {k: v for k, v in r.items() if not isinstance(v, float) or v > 1e-3})
    assert r["engine_bytes"] == 600_000
    assert r["full_bytes"] > r["engine_bytes"]  # safetensors header on top of the raw bytes
    assert 0 < r["delta_bytes"] < 0.2 * r["full_bytes"]
    assert r["delta_ratio"] == pytest.approx(r["delta_bytes"] / r["full_bytes"])
    # ~2% of elements move by one ulp: the low byte changes, the high byte rarely
    assert 0.005 < r["changed_bytes"] / r["engine_bytes"] < 0.02
    for k in ("full_seconds", "encode_seconds", "apply_seconds"):
        assert r[k] > 0
