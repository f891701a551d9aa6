"""Tests for the fast paths of weight sync: the sparse zstd encoder (lichen.weights.zstd_seq), the fused cast +
diff encoder, the file-region apply and the engine's staging buffers (lichen.weights.staging).

References are independent of the code under test: frames are decoded with python-zstandard, the parse is
checked against a byte-by-byte Python loop, casts against torch's `.to(dtype)`, file contents against numpy.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest
import torch
import zstandard

import lichen.weights
from lichen.weights import VersionPublisher, diff_kernel, pull_weights, read_version_info, version_dir
from lichen.weights import delta_codec as D
from lichen.weights import zstd_seq as Z
from lichen.weights.native import Native, Unavailable
from lichen.weights.parallel import parallel_map, serial_torch
from lichen.weights.staging import LiveStage, reserve

needs_seq = pytest.mark.skipif(not Z.available(), reason=f"libzstd sequence encoder: {Z.status()}")


def _sparse(n: int, density: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return ((rng.random(n) < density) * rng.integers(1, 256, n)).astype(np.uint8)


def _naive_sequences(x: np.ndarray) -> list[tuple[int, int, int]]:
    """(offset, literal length, match length) per maximal run of zero 8-byte words, found byte by byte: the match
    covers the run widened to the zero bytes of its neighbouring words, minus one zero literal before it."""
    b = x.tolist()
    n_words = len(b) // 8
    zero_word = [not any(b[8 * w : 8 * w + 8]) for w in range(n_words)]
    out, prev_end, w = [], 0, 0
    while w < n_words:
        if not zero_word[w]:
            w += 1
            continue
        lo = w
        while w < n_words and zero_word[w]:
            w += 1
        start = 8 * lo
        while start > 0 and b[start - 1] == 0:  # back over the zero bytes of the word before
            start -= 1
        start += 1  # one zero literal: the byte the match repeats
        end = 8 * w
        if w < n_words:
            while b[end] == 0:
                end += 1
        out.append((1, start - prev_end, end - start))
        prev_end = end
    return out


@needs_seq
@pytest.mark.parametrize("chunk_words", [Z._PARSE_CHUNK_WORDS, 3])  # 3: runs cross many parse chunks
def test_parse_matches_a_byte_by_byte_reference(chunk_words, monkeypatch):
    monkeypatch.setattr(Z, "_PARSE_CHUNK_WORDS", chunk_words)
    for seed, (n, density) in enumerate(
        [(0, 0.0), (5, 0.5), (8, 0.0), (64, 0.0), (203, 0.05), (1000, 0.02), (2048, 0.3), (4099, 0.9), (777, 1.0)]
    ):
        x = _sparse(n, density, seed)
        got = [tuple(int(v) for v in row[:3]) for row in Z.Parser(x).finish()]
        assert got == _naive_sequences(x), (n, density)


@needs_seq
def test_sparse_frames_decode_exactly_with_python_zstandard():
    cases = [
        _sparse(n, d, i)
        for i, (n, d) in enumerate(
            [
                (1, 1.0),
                (7, 0.0),
                (9, 0.5),
                (131_072, 0.02),
                (131_075, 0.3),
                (3 << 20, 0.0005),
                ((1 << 20) + 13, 0.9),
                (3 << 20, 1.0),
            ]
        )
    ]  # the last: incompressible, more than the first output buffer (the retry)
    edge = np.zeros(3 << 20, np.uint8)  # zero runs that end exactly at, and run across, parse-chunk edges
    edge[(1 << 20) - 1], edge[(2 << 20) + 9], edge[-1] = 5, 7, 1
    for x in cases + [edge]:
        frame = Z.compress_sparse(x)
        assert zstandard.get_frame_parameters(frame).content_size == x.size
        assert zstandard.ZstdDecompressor().decompress(frame) == x.tobytes()


@needs_seq
def test_one_thread_may_change_levels_between_frames():  # a finished session must not block the next parameters
    x = _sparse(300_000, 0.02, 9)
    for level in (1, 3, 1, 19):
        assert zstandard.ZstdDecompressor().decompress(Z.compress_sparse(x, level)) == x.tobytes()


@needs_seq
def test_sparse_frame_is_smaller_than_zstd_level_1_on_a_bf16_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1 << 20, generator=g) * 0.02
    stepped = w - 1e-6 * torch.sign(torch.randn(w.shape, generator=g))  # an AdamW-like first step
    x = (w.to(torch.bfloat16).view(torch.int16) ^ stepped.to(torch.bfloat16).view(torch.int16)).view(torch.uint8)
    x = x.numpy()
    ours = len(Z.compress_sparse(x))
    print(
        f"\nbf16 step: {np.count_nonzero(x) / x.size:.2%} bytes changed, sparse frame {ours / x.size:.2%}, "
        f"zstd -1 {len(zstandard.ZstdCompressor(level=1).compress(x)) / x.size:.2%}"
    )
    assert ours < len(zstandard.ZstdCompressor(level=1).compress(x)) and ours < 0.05 * x.size


def test_encoder_falls_back_to_python_zstandard(monkeypatch):
    monkeypatch.setattr(Z._native, "value", None)
    monkeypatch.setattr(Z._native, "state", "unavailable: test")
    assert not Z.available() and Z.compress_sparse(np.zeros(8, np.uint8)) is None
    old, new = _sparse(5000, 0.5, 1), _sparse(5000, 0.5, 2)
    enc = D.encode_tensor("xor", new, old)
    assert zstandard.ZstdDecompressor().decompress(enc.payload) == (new ^ old).tobytes()


# ---------------------------------------------------------------- compiled diff + parse (lichen.weights.diff_kernel)

needs_kernel = pytest.mark.skipif(
    not (Z.available() and diff_kernel.available()),
    reason=f"compiled diff kernel: {diff_kernel.status()}; sequences: {Z.status()}",
)


def _kernel_diff(new: np.ndarray, old: np.ndarray, chunk: int, update: bool):
    """Drive Parser.diff over `chunk`-byte pieces: (x after the pass, rows, changed count, old after)."""
    x, o = new.copy(), old.copy()
    parser = Z.Parser(x)
    changed = sum(parser.diff(a, min(a + chunk, x.size), o, update) for a in range(0, x.size, chunk))
    rows = [tuple(int(v) for v in row[:3]) for row in parser.finish()]
    return x, rows, changed, o


@needs_kernel
@pytest.mark.parametrize("chunk", [8, 24, 4096, 1 << 20])  # 8: every word its own call; runs cross many calls
def test_kernel_diff_matches_references(chunk):
    for seed, (n, density) in enumerate(
        [
            (0, 0.0),
            (5, 0.5),
            (8, 0.0),
            (64, 0.0),
            (203, 0.05),
            (1000, 0.02),
            (2048, 0.3),
            (4099, 0.9),
            (777, 1.0),
            (65_541, 0.01),
        ]
    ):
        old = _sparse(n, 0.7, 100 + seed)
        new = old ^ _sparse(n, density, seed)
        for update in (True, False):
            x, rows, changed, o = _kernel_diff(new, old, chunk, update)
            assert np.array_equal(x, new ^ old), (n, density)
            assert rows == _naive_sequences(new ^ old), (n, density, chunk)
            assert changed == int(np.count_nonzero(new ^ old))
            assert np.array_equal(o, new if update else old)


@needs_kernel
def test_kernel_counts_exactly_past_its_16_bit_lanes():
    """A 1 MiB chunk has 131072 words; the byte counters are 16-bit lanes summed every 65535 words."""
    for density in (1.0, 0.3):
        old = _sparse((1 << 20) + 24, 0.5, 7)
        new = old ^ _sparse(old.size, density, 8)
        x, rows, changed, o = _kernel_diff(new, old, 1 << 20, True)
        assert changed == int(np.count_nonzero(new ^ old)) and np.array_equal(x, new ^ old)
        assert np.array_equal(o, new)


@needs_kernel
def test_row_totals_match_numpy():
    rows = np.random.default_rng(2).integers(3, 1 << 20, (1000, 4)).astype(np.uint32)
    want = (int(rows[:, 1].sum(dtype=np.int64) + rows[:, 2].sum(dtype=np.int64)), int(rows[:, 2].min()))
    assert diff_kernel.row_totals(rows) == want


@needs_kernel
def test_kernel_and_numpy_paths_write_identical_payloads(monkeypatch):
    """The compiled passes must produce the very payloads the numpy passes do (same parse, same snapshot update;
    for overwrite the same offsets and values), for a cast step and for raw bytes with and without update_old."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(300_007, generator=g) * 0.02
    stepped = w - 1e-6 * torch.sign(torch.randn(w.shape, generator=g))
    old = D.tensor_bytes(w.to(torch.bfloat16))
    new = D.tensor_bytes(stepped.to(torch.bfloat16))
    monkeypatch.setattr(D, "CHUNK_BYTES", 4096)
    results = []
    for use_kernel in (True, False):
        if not use_kernel:
            monkeypatch.setattr(diff_kernel._native, "value", None)
            monkeypatch.setattr(diff_kernel._native, "state", "unavailable: test")
        got = []
        for encoding in ("xor", "overwrite"):
            snap = old.copy()
            enc = D.encode_tensor_cast(encoding, stepped, snap, torch.bfloat16, checksum_format="xxh3-128")
            got.append((enc.payload, enc.changed_bytes, enc.checksum, snap.tobytes()))
            for update in (True, False):
                snap = old.copy()
                enc = D.encode_tensor(encoding, new, snap, checksum_format="xxh3-128", update_old=update)
                got.append((enc.payload, enc.changed_bytes, enc.checksum, snap.tobytes()))
        results.append(got)
    assert results[0] == results[1]
    assert results[0][0][3] == new.tobytes()  # the snapshot holds the new bytes
    back = old.copy()
    D.apply_tensor("overwrite", results[0][3][0], back)
    assert np.array_equal(back, new)


def test_kernel_availability_follows_numba_and_the_switch():
    """numba is a dependency: a kernel that fails to build or its self-test must not pass unnoticed (the encoder
    would silently fall back to the slower numpy pass, and the kernel tests above would skip). Where numba is
    missing (Pythons it has no wheels for) or LICHEN_NUMBA=0, the status must say which."""
    has_numba = importlib.util.find_spec("numba") is not None
    switched_off = os.environ.get("LICHEN_NUMBA") == "0"
    if has_numba and not switched_off:
        assert diff_kernel.available(), diff_kernel.status()
    elif switched_off:
        assert not diff_kernel.available() and diff_kernel.status() == "unavailable: LICHEN_NUMBA=0"
    else:
        assert not diff_kernel.available() and "ModuleNotFoundError" in diff_kernel.status()


def test_native_loads_once_and_reports_why_it_is_unavailable(monkeypatch):
    calls = []

    def load():
        calls.append(1)
        return "lib"

    seen = []
    ok = Native(load, lambda v: seen.append(ok.value) or None, "LICHEN_TEST_NATIVE")
    assert ok.get() == "lib" and ok.get() == "lib" and ok.status() == "ok"
    assert calls == [1] and seen == ["lib"]  # loaded once; the value is visible during its self-test

    bad = Native(load, lambda v: "wrong answer", "LICHEN_TEST_NATIVE")
    assert bad.get() is None and bad.status() == "unavailable: wrong answer"

    def missing():
        raise Unavailable("no such library")

    assert Native(missing, lambda v: None, "LICHEN_TEST_NATIVE").status() == "unavailable: no such library"

    def broken():
        raise OSError("bad ELF")

    assert Native(broken, lambda v: None, "LICHEN_TEST_NATIVE").status() == "unavailable: OSError: bad ELF"

    monkeypatch.setenv("LICHEN_TEST_NATIVE", "0")
    off, loads = Native(load, lambda v: None, "LICHEN_TEST_NATIVE"), len(calls)
    assert not off.available() and off.status() == "unavailable: LICHEN_TEST_NATIVE=0"
    assert len(calls) == loads  # switched off: not even loaded


@needs_kernel
@pytest.mark.slow
def test_kernel_compiles_without_a_cache_directory(monkeypatch):
    import numba

    real = numba.njit

    def njit(*args, **kwargs):  # what numba raises where no cache directory is writable
        if kwargs.get("cache"):
            raise RuntimeError("cannot cache function 'f': no locator available for file 'x.py'")
        return real(*args, **kwargs)

    monkeypatch.setattr(numba, "njit", njit)
    monkeypatch.setattr(diff_kernel._native, "value", None)
    monkeypatch.setattr(diff_kernel._native, "state", "unloaded")
    monkeypatch.delitem(sys.modules, "lichen.weights._diff_kernel_jit")  # decorate again, under the patched njit
    monkeypatch.delattr(lichen.weights, "_diff_kernel_jit")
    assert diff_kernel.available(), diff_kernel.status()
    assert (
        type(diff_kernel._native.value.diff_parse._cache).__name__ == "NullCache"
    )  # compiled without an on-disk cache


def test_kernel_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(diff_kernel._native, "value", None)
    monkeypatch.setattr(diff_kernel._native, "state", "unloaded")
    monkeypatch.setenv("LICHEN_NUMBA", "0")
    assert not diff_kernel.available() and diff_kernel.status() == "unavailable: LICHEN_NUMBA=0"
    old, new = _sparse(5000, 0.5, 1), _sparse(5000, 0.5, 2)
    enc = D.encode_tensor("xor", new, old)
    assert zstandard.ZstdDecompressor().decompress(enc.payload) == (new ^ old).tobytes()


# ---------------------------------------------------------------- fused cast + diff


def _special_fp32(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, generator=g) * 0.02
    t[:8] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 3.4e38, 65504.0, 1 + 2**-8])
    return t


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("encoding", D.ENCODINGS)
def test_encode_tensor_cast_equals_cast_then_encode(dtype, encoding, monkeypatch):
    monkeypatch.setattr(D, "CHUNK_BYTES", 4096)  # many chunks
    old_fp32 = _special_fp32(10_000, 0)
    new_fp32 = old_fp32.clone()
    new_fp32[8::7] += 1e-3
    trainer = new_fp32.reshape(100, 100).t()  # non-contiguous, as a transposed trainer weight may be
    old_b = old_fp32.to(dtype).view(torch.uint8).numpy().copy()
    want_new = trainer.contiguous().reshape(-1).to(dtype).view(torch.uint8).numpy()
    snapshot = old_b.copy()
    enc = D.encode_tensor_cast(encoding, trainer, snapshot, dtype, checksum_format="xxh3-128")
    assert np.array_equal(snapshot, want_new)  # the snapshot now holds exactly torch's cast
    assert enc.checksum == D.checksum("xxh3-128", want_new)
    assert enc.changed_bytes == int(np.count_nonzero(old_b != want_new))
    out, digest = D.decode_tensor(encoding, enc.payload, old_b, checksum_format="xxh3-128")
    assert np.array_equal(out, want_new) and digest == enc.checksum
    assert D.encode_tensor_cast(encoding, trainer, snapshot, dtype) is None  # nothing changed since


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cast_checksum_hashes_the_cast_bytes(dtype, monkeypatch):
    monkeypatch.setattr(D, "CHUNK_BYTES", 4096)
    t = _special_fp32(30_000, 1).reshape(300, 100)
    for x in (t, t.t(), t[:, 7:93]):  # contiguous, transposed, a strided slice
        want = D.checksum("blake3", x.contiguous().to(dtype).reshape(-1).view(torch.uint8).numpy())
        assert D.cast_checksum("blake3", x, dtype) == want
    ints = torch.arange(12)
    assert D.cast_checksum("adler32", ints, dtype) == D.checksum("adler32", ints.numpy().tobytes())


def test_nonzero_positions_equal_flatnonzero(monkeypatch):
    monkeypatch.setattr(D, "CHUNK_BYTES", 64)  # many word chunks
    for seed, (n, density) in enumerate([(0, 0.0), (7, 1.0), (8, 0.5), (1001, 0.02), (4096, 0.3), (999, 1.0)]):
        x = _sparse(n, density, seed)
        assert np.array_equal(D._nonzero_positions(x), np.flatnonzero(x)), (n, density)


def test_serial_torch_is_per_call_and_restores():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with serial_torch():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        assert parallel_map(lambda _: torch.get_num_threads(), range(4), 2) == [1, 1, 1, 1]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------- file-region apply with a stage


@pytest.mark.parametrize("encoding", D.ENCODINGS)
def test_apply_tensor_at_changes_only_its_region(encoding, tmp_path, monkeypatch):
    monkeypatch.setattr(D, "CHUNK_BYTES", 1000)  # chunks that are not a multiple of anything
    old, new = _sparse(7_777, 0.9, 3), _sparse(7_777, 0.9, 3)
    new[::13] ^= 0x21
    enc = D.encode_tensor(encoding, new, old, checksum_format="blake3")
    head, tail = b"H" * 123, b"T" * 45
    path = tmp_path / "f.bin"
    path.write_bytes(head + old.tobytes() + tail)
    fd = os.open(path, os.O_RDWR)
    try:
        assert (
            D.apply_tensor_at(encoding, enc.payload, fd, len(head), old.size, checksum_format="blake3") == enc.checksum
        )
        assert path.read_bytes() == head + new.tobytes() + tail
        with pytest.raises(D.DeltaError, match="tensor holds 7776"):
            D.apply_tensor_at("xor", D.encode_tensor("xor", new, old).payload, fd, 0, old.size - 1)
    finally:
        os.close(fd)


@pytest.mark.parametrize("encoding", D.ENCODINGS)
def test_apply_tensor_from_a_source_leaves_the_source_alone(encoding, monkeypatch):
    monkeypatch.setattr(D, "CHUNK_BYTES", 1000)
    old, new = _sparse(5_003, 0.5, 4), _sparse(5_003, 0.5, 5)
    enc = D.encode_tensor(encoding, new, old, checksum_format="xxh3-128")
    source, target = old.copy(), np.full_like(old, 0xAB)
    assert D.apply_tensor(encoding, enc.payload, target, source=source, checksum_format="xxh3-128") == enc.checksum
    assert np.array_equal(target, new) and np.array_equal(source, old)
    with pytest.raises(ValueError, match="source holds 5002"):
        D.apply_tensor(encoding, enc.payload, target, source=source[:-1])


# ---------------------------------------------------------------- staging


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(32, 48, generator=g) * 0.02 for i in range(4)} | {"norm": torch.ones(48)}


def _bump(sd: dict[str, torch.Tensor], names: list[str], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: (v + 1e-3 * torch.randn(v.shape, generator=g) if k in names else v.clone()) for k, v in sd.items()}


def _bf16(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to(torch.bfloat16) for k, v in sd.items()}


def test_pull_fills_the_stage_and_swap_serves_the_target(tmp_path):
    disk, local = str(tmp_path / "d"), str(tmp_path / "local")
    pub = VersionPublisher(disk, dtype=torch.bfloat16)
    v1 = _state(0)
    v2 = _bump(v1, ["w0", "w1"], 1)
    v3 = _bump(v2, ["w1", "w3"], 2)
    pub.publish(v1, 1)
    pull_weights(local, disk, 1)
    chain = read_version_info(version_dir(disk, 1)).chain_id
    live = _bf16(v1)
    first = {k: v for k, v in live.items()}  # the tensor objects the engine holds
    spare: dict[str, torch.Tensor] = {}
    assert reserve(live, spare) == sum(v.numel() * 2 for v in live.values()) and reserve(live, spare) == 0
    stage = LiveStage(live, 1, chain, spare=spare)
    pub.publish(v2, 2)
    pub.publish(v3, 3)
    res = pull_weights(local, disk, 3, stage=stage)  # two deltas, each decoded once
    assert res.deltas_applied == [2, 3] and stage.usable and stage.version == 3
    assert sorted(stage.staged) == ["w0", "w1", "w3"]
    assert all(torch.equal(live[k], _bf16(v1)[k]) for k in live)  # the served weights did not move
    assert stage.swap_in() == 3
    assert all(torch.equal(live[k], _bf16(v3)[k]) for k in live) and all(live[k] is first[k] for k in live)
    assert sorted(spare) == sorted(live) and all(torch.equal(spare[k], _bf16(v1)[k]) for k in ["w0", "w1", "w3"])


def test_stage_is_refused_or_failed_but_the_pull_still_succeeds(tmp_path):
    disk, local = str(tmp_path / "d"), str(tmp_path / "local")
    pub = VersionPublisher(disk, dtype=torch.bfloat16)
    v1 = _state(3)
    v2 = _bump(v1, ["w2"], 4)
    v3 = _bump(v2, ["w0"], 5)
    pub.publish(v1, 1)
    pull_weights(local, disk, 1)
    chain = read_version_info(version_dir(disk, 1)).chain_id
    pub.publish(v2, 2)
    ahead = LiveStage(_bf16(v2), 2, chain)  # the engine serves 2, the local copy holds 1: not stageable
    assert pull_weights(local, disk, 2, stage=ahead).deltas_applied == [2]
    assert not ahead.usable and not ahead.staged
    pub.publish(v3, 3)
    wrong = _bf16(v2)
    wrong["w0"][0, 0] += 1  # live bytes that are not version 2: the staged checksum cannot match
    stage = LiveStage(wrong, 2, chain)
    assert pull_weights(local, disk, 3, stage=stage).deltas_applied == [3]
    assert not stage.usable and "w0" in stage.failed
    with pytest.raises(RuntimeError, match="unusable"):
        stage.swap_in()
    with pytest.raises(ValueError, match="contiguous"):
        LiveStage({"t": torch.zeros(4, 4).t()}, 1, chain)


def test_the_weight_threads_follow_the_environment(monkeypatch):
    """LICHEN_WEIGHT_THREADS sets the pools' size per process (a rank's delta encode on its share of a host's
    cores); unset, the cores up to 8; a bad value is one error naming the variable."""
    import threading

    from lichen.weights.parallel import THREADS_ENV, default_threads

    def threads_used() -> int:
        seen: set[int] = set()
        parallel_map(lambda _: seen.add(threading.get_ident()), range(64))
        return len(seen)

    monkeypatch.delenv(THREADS_ENV, raising=False)
    assert default_threads() == max(1, min(8, os.cpu_count() or 1))
    monkeypatch.setenv(THREADS_ENV, "1")
    assert default_threads() == 1 and threads_used() == 1
    monkeypatch.setenv(THREADS_ENV, "3")
    assert default_threads() == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(THREADS_ENV, bad)
        with pytest.raises(ValueError, match=THREADS_ENV):
            default_threads()
