"""The per-tensor weight delta codec: encode, apply, verify (the payloads of docs/weight-format.md#payloads).

A tensor is treated as its raw bytes in the engine dtype (`tensor_bytes`). Between two versions `old` and `new`
of those bytes, one tensor's delta payload is a single zstd frame (content size in the header) holding:

- `xor`:       `new ^ old`, byte by byte. Applying computes `old ^ payload`; XOR is its own inverse, so applying
               it twice gives back `old`: a xor delta must be applied exactly once, on exactly its base.
- `overwrite`: `u32 count | u32 positions[count] | u8 values[count]` (little-endian), the byte offsets where
               `new != old` (ascending) and the new bytes there. Applying sets `target[positions] = values`,
               which is idempotent and ignores the old bytes at those positions. Offsets are u32, so a tensor
               must hold at most 2**32 bytes.

Every changed tensor also carries a checksum of its new bytes, in one of `CHECKSUM_FORMATS`:
`xxh3-128` (xxhash hexdigest, 32 hex digits), `blake3` (64 hex digits), `adler32` (zlib, 8 hex digits).

Encoding and applying stream each tensor in `CHUNK_BYTES` pieces through per-thread buffers that are reused
(fill, hash, xor, count, parse and update one piece while it is in cache; a fresh model-sized array would cost a
page fault per 4 KiB). xor payloads are built by lichen.weights.zstd_seq (the matches of a sparse delta are found
by lichen.weights.diff_kernel's compiled pass, or numpy without numba; libzstd only entropy-codes them) when
the system's libzstd allows, else by python-zstandard; both are ordinary zstd frames. zstd, numpy ufuncs, the
compiled kernels, ctypes calls and the hashes release the GIL, so a thread pool over tensors (lichen.weights.parallel)
uses every core.

This module is a leaf: torch, numpy, zstandard, xxhash, blake3, the standard library, lichen.weights.zstd_seq and
lichen.weights.diff_kernel.
"""

from __future__ import annotations

import os
import sys
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import blake3
import numpy as np
import torch
import xxhash
import zstandard

from lichen.weights import diff_kernel, zstd_seq

ENCODINGS = ("xor", "overwrite")
CHECKSUM_FORMATS = ("xxh3-128", "blake3", "adler32")
COMPRESSION_FORMAT = "zstd"
CHUNK_BYTES = 1 << 20
_U32_LIMIT = 1 << 32


class DeltaError(RuntimeError):
    """A delta or version that cannot be applied: malformed payload, wrong size, missing file or checksum."""


class ChecksumMismatchError(DeltaError):
    """The bytes after applying (or copying) a tensor do not hash to the checksum its version recorded."""

    def __init__(self, mismatches: list[tuple[str, str]], where: str):
        self.mismatches = mismatches  # (tensor name, file)
        shown = "; ".join(f"tensor {n!r} in {f}" for n, f in mismatches[:10])
        more = f" (and {len(mismatches) - 10} more)" if len(mismatches) > 10 else ""
        super().__init__(
            f"checksum mismatch for {len(mismatches)} tensor(s) after applying {where}: {shown}{more}."
            " The published files or the local copy are corrupt; the version was not applied."
        )


class VersionMismatchError(DeltaError):
    """A delta whose base version is not the version the target holds (out of order, or another chain)."""


def check_encoding(encoding: str) -> str:
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown delta encoding {encoding!r}; expected one of {', '.join(ENCODINGS)}")
    return encoding


def check_checksum_format(checksum_format: str) -> str:
    if checksum_format not in CHECKSUM_FORMATS:
        raise ValueError(f"unknown checksum format {checksum_format!r}; expected one of {', '.join(CHECKSUM_FORMATS)}")
    return checksum_format


class _Adler32:
    """zlib.adler32 behind the update/hexdigest interface of the hash objects."""

    def __init__(self) -> None:
        self._value = 1

    def update(self, data) -> None:
        self._value = zlib.adler32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


def new_hasher(checksum_format: str):
    """An incremental hasher (`update(bytes-like)`, `hexdigest()`) for one of `CHECKSUM_FORMATS`."""
    check_checksum_format(checksum_format)
    if checksum_format == "xxh3-128":
        return xxhash.xxh3_128()
    if checksum_format == "blake3":
        return blake3.blake3()
    return _Adler32()


def checksum(checksum_format: str, data) -> str:
    """Hex digest of a bytes-like object (numpy arrays included) in `checksum_format`."""
    h = new_hasher(checksum_format)
    h.update(data)
    return h.hexdigest()


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of a CPU tensor as a flat uint8 numpy array, sharing memory with it when contiguous
    (writes through). A non-contiguous tensor is copied first (then writes do not reach it)."""
    if t.device.type != "cpu":
        raise ValueError(f"tensor_bytes needs a CPU tensor, got one on {t.device}")
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def _as_u8(a, what: str) -> np.ndarray:
    arr = np.asarray(a)
    if arr.dtype != np.uint8 or arr.ndim != 1:
        raise TypeError(f"{what} must be a 1-D uint8 array (see tensor_bytes), got {arr.dtype} with shape {arr.shape}")
    return arr


@dataclass(frozen=True)
class EncodedTensor:
    """One changed tensor: its zstd payload, how many of its bytes differ, and the checksum of its new bytes."""

    payload: bytes
    changed_bytes: int
    checksum: str | None


_local = threading.local()


def _scratch(name: str, nbytes: int) -> np.ndarray:
    """A per-thread uint8 buffer of at least `nbytes`, reused across calls: a fresh large array costs a page fault
    per 4 KiB on first touch, which on a small machine is slower than the work done in it."""
    buf = getattr(_local, name, None)
    if buf is None or buf.size < nbytes:
        buf = np.empty(max(nbytes, 1 << 16), dtype=np.uint8)
        setattr(_local, name, buf)
    return buf[:nbytes]


def _chunk_bytes(itemsize: int = 1) -> int:
    return max(itemsize, CHUNK_BYTES // itemsize * itemsize)


def _diff_pass(
    encoding: str,
    n: int,
    fill: Callable[[int, int, np.ndarray], None],
    old: np.ndarray,
    hasher,
    update_old: bool,
    itemsize: int = 1,
) -> tuple[np.ndarray, int, zstd_seq.Parser | None]:
    """One streaming pass over `n` bytes: `fill(start, stop, out)` writes the new bytes [start, stop) into a
    per-thread buffer, which is hashed, then turned into `new ^ old` in place; `old` takes the new bytes where they
    differ (with `update_old`). Returns (the xor bytes in the per-thread buffer, count of nonzero xor bytes, the
    zstd sequence parser of the xor bytes, or None). Each chunk is filled, hashed, xor-ed, counted, parsed and
    written back while it is in cache."""
    delta = _scratch("delta", n)
    parser = zstd_seq.parser_for(delta) if encoding == "xor" else None
    fused = parser is not None and diff_kernel.available()
    compiled = parser is None and diff_kernel.available()
    step = _chunk_bytes(max(itemsize, 8))
    changed = 0
    for start in range(0, n, step):
        stop = min(start + step, n)
        d, o = delta[start:stop], old[start:stop]
        fill(start, stop, d)
        if hasher is not None:
            hasher.update(d)
        if fused:
            changed += parser.diff(start, stop, old, update_old)
            continue
        if compiled:
            changed += diff_kernel.xor_count(d, o, update_old)
            continue
        np.bitwise_xor(d, o, out=d)
        count = int(np.count_nonzero(d))
        if count:
            changed += count
            if update_old:
                np.bitwise_xor(o, d, out=o)
        if parser is not None and count:
            parser.feed(stop // 8)
    return delta, changed, parser


def _payload(
    encoding: str,
    delta: np.ndarray,
    old: np.ndarray,
    changed: int,
    level: int,
    old_is_new: bool,
    parser: zstd_seq.Parser | None = None,
) -> bytes:
    """The zstd payload of the xor bytes `delta` (see the module doc). For overwrite, the new byte values are
    `old` where `old_is_new` (the snapshot was updated), else `old ^ delta`."""
    if encoding == "xor":
        frame = zstd_seq.compress_sparse(delta, level, parser)
        return frame if frame is not None else zstandard.ZstdCompressor(level=level).compress(delta)
    if diff_kernel.available() and sys.byteorder == "little":  # one compiled pass writes the raw payload
        raw = np.empty(4 + 5 * changed, np.uint8)
        raw[:4] = np.frombuffer(changed.to_bytes(4, "little"), np.uint8)
        found = diff_kernel.changed_bytes(
            delta, old, old_is_new, raw[4 : 4 + 4 * changed].view(np.uint32), raw[4 + 4 * changed :]
        )
        if found != changed:
            raise AssertionError(f"overwrite: {found} changed bytes found, {changed} counted")
        return zstandard.ZstdCompressor(level=level).compress(raw)
    pos = _nonzero_positions(delta)
    values = old[pos] if old_is_new else old[pos] ^ delta[pos]
    raw = b"".join([changed.to_bytes(4, "little"), pos.astype("<u4").tobytes(), values.tobytes()])
    return zstandard.ZstdCompressor(level=level).compress(raw)


def _nonzero_positions(x: np.ndarray) -> np.ndarray:
    """`np.flatnonzero(x)` of a sparse uint8 array, ~4x faster: find the nonzero 8-byte words first (1 MiB at a
    time), then the nonzero bytes inside those words only."""
    n_words = x.size // 8
    parts = []
    step = max(1, _chunk_bytes() // 8)
    for w0 in range(0, n_words, step):
        words = x[8 * w0 : 8 * min(w0 + step, n_words)].view(np.uint64)
        hit = np.flatnonzero(words)
        if hit.size:
            inner = np.flatnonzero(x[8 * w0 : 8 * w0 + 8 * words.size].reshape(-1, 8)[hit])
            parts.append(8 * (hit[inner >> 3] + w0) + (inner & 7))
    tail = np.flatnonzero(x[8 * n_words :])
    if tail.size:
        parts.append(tail + 8 * n_words)
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _check_pair(encoding: str, n: int, old: np.ndarray, update_old: bool) -> None:
    check_encoding(encoding)
    if update_old and not old.flags.writeable:
        raise ValueError("update_old needs a writable old array")
    if encoding == "overwrite" and n > _U32_LIMIT:
        raise DeltaError(
            f"overwrite deltas address bytes with u32 offsets; a tensor of {n} bytes is too large "
            "(use the xor encoding)"
        )


def encode_tensor(
    encoding: str, new, old, *, checksum_format: str | None = None, level: int = 1, update_old: bool = False
) -> EncodedTensor | None:
    """The delta payload taking bytes `old` to bytes `new` (equal lengths), or None when they are identical.

    With `update_old`, `old` is overwritten with `new` where they differ (the snapshot then equals `new`),
    in the same pass. `checksum_format` adds the checksum of `new`. `level` is the zstd level.
    """
    check_encoding(encoding)
    new, old = _as_u8(new, "new"), _as_u8(old, "old")
    if new.size != old.size:
        raise ValueError(f"new and old bytes differ in length: {new.size} vs {old.size}")
    _check_pair(encoding, new.size, old, update_old)
    hasher = new_hasher(checksum_format) if checksum_format else None
    delta, changed, parser = _diff_pass(
        encoding, new.size, lambda a, b, out: np.copyto(out, new[a:b]), old, hasher, update_old
    )
    if not changed:
        return None
    return EncodedTensor(
        _payload(encoding, delta, old, changed, level, update_old, parser),
        changed,
        hasher.hexdigest() if hasher is not None else None,
    )


def encode_tensor_cast(
    encoding: str,
    tensor: torch.Tensor,
    old: np.ndarray,
    dtype: torch.dtype,
    *,
    checksum_format: str | None = None,
    level: int = 1,
) -> EncodedTensor | None:
    """`encode_tensor(encoding, bytes of tensor.to(dtype), old, update_old=True)` without materialising the cast
    tensor: each chunk is cast by torch straight into the per-thread buffer (bit-identical to `.to(dtype)`).
    `tensor` is a CPU tensor of any dtype with `old.size / dtype itemsize` elements; `old` (the snapshot, a
    writable uint8 array) ends holding the new bytes."""
    old = _as_u8(old, "old")
    itemsize = torch.empty((), dtype=dtype).element_size()
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.to("cpu")
    if flat.numel() * itemsize != old.size:
        raise ValueError(f"the tensor holds {flat.numel()} elements of {dtype} but the snapshot {old.size} bytes")
    _check_pair(encoding, old.size, old, True)
    hasher = new_hasher(checksum_format) if checksum_format else None

    def fill(start: int, stop: int, out: np.ndarray) -> None:
        torch.from_numpy(out).view(dtype).copy_(flat[start // itemsize : stop // itemsize])

    delta, changed, parser = _diff_pass(encoding, old.size, fill, old, hasher, True, itemsize)
    if not changed:
        return None
    return EncodedTensor(
        _payload(encoding, delta, old, changed, level, True, parser),
        changed,
        hasher.hexdigest() if hasher is not None else None,
    )


def cast_checksum(checksum_format: str, tensor: torch.Tensor, dtype: torch.dtype) -> str:
    """The checksum of the bytes of `tensor.to(dtype)` (floating point only; other tensors keep their dtype), cast
    chunk by chunk into a per-thread buffer instead of materialising the cast tensor."""
    t = tensor.detach()
    if not t.is_floating_point():
        dtype = t.dtype
    flat = t.reshape(-1) if t.device.type == "cpu" else t.reshape(-1).to("cpu")
    itemsize = torch.empty((), dtype=dtype).element_size()
    hasher = new_hasher(checksum_format)
    if flat.dtype == dtype and flat.is_contiguous():
        hasher.update(tensor_bytes(flat))
        return hasher.hexdigest()
    step = _chunk_bytes(itemsize) // itemsize
    buf = _scratch("cast", min(step, flat.numel()) * itemsize)
    for start in range(0, flat.numel(), step):
        part = flat[start : start + step]
        out = buf[: part.numel() * itemsize]
        torch.from_numpy(out).view(dtype).copy_(part)
        hasher.update(out)
    return hasher.hexdigest()


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


def _decompress_all(payload) -> bytes:
    try:
        size = zstandard.frame_content_size(payload)
        if size >= 0:
            return _decompressor().decompress(payload)
        return zstandard.ZstdDecompressor().decompressobj().decompress(bytes(payload))
    except zstandard.ZstdError as e:
        raise DeltaError(f"cannot decompress the zstd payload ({e})") from None


def apply_tensor(encoding: str, payload, target, *, checksum_format: str | None = None, source=None) -> str | None:
    """Apply one payload to the bytes `target` in place; return the checksum of the result (None without
    `checksum_format`). With `source` (bytes of the same length), the old bytes are read from `source` and only
    the result goes to `target` (one pass; `source` is not changed unless it is `target`). Raises DeltaError for
    a payload that does not fit (wrong size, bad frame, offsets out of range); a xor payload found bad midway
    may leave `target` partly changed."""
    check_encoding(encoding)
    target = _as_u8(target, "target")
    if not target.flags.writeable:
        raise ValueError("apply_tensor needs a writable target array")
    old = target if source is None else _as_u8(source, "source")
    if old.size != target.size:
        raise ValueError(f"source holds {old.size} bytes, target {target.size}")
    n = target.size
    hasher = new_hasher(checksum_format) if checksum_format else None
    if encoding == "xor":

        def sink(pos: int, delta: np.ndarray) -> None:
            out = target[pos : pos + delta.size]
            np.bitwise_xor(old[pos : pos + delta.size], delta, out=out)
            if hasher is not None:
                hasher.update(out)

        _xor_stream(payload, n, sink)
    else:
        raw = np.frombuffer(_decompress_all(payload), dtype=np.uint8)
        if raw.size < 4:
            raise DeltaError(f"overwrite payload decodes to {raw.size} bytes; it needs at least a 4-byte count")
        count = int.from_bytes(raw[:4].tobytes(), "little")
        if raw.size != 4 + 5 * count:
            raise DeltaError(f"overwrite payload holds {raw.size} bytes; count {count} needs {4 + 5 * count}")
        pos = np.frombuffer(raw, dtype="<u4", count=count, offset=4)
        if count and int(pos.max()) >= n:
            raise DeltaError(f"overwrite offset {int(pos.max())} is outside the {n}-byte tensor")
        if old is not target:
            np.copyto(target, old)
        target[pos] = raw[4 + 4 * count :]
        if hasher is not None:
            hasher.update(target)
    return hasher.hexdigest() if hasher is not None else None


def _xor_stream(payload, n: int, sink: Callable[[int, np.ndarray], None]) -> None:
    """Decompress a xor payload of `n` bytes chunk by chunk into a per-thread buffer, handing each chunk to
    `sink(position, chunk)` while it is in cache. Raises DeltaError for a frame that is bad or of another size."""
    try:
        declared = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as e:
        raise DeltaError(f"not a zstd frame ({e})") from None
    if declared >= 0 and declared != n:
        raise DeltaError(f"xor payload decodes to {declared} bytes but the tensor holds {n}")
    step = _chunk_bytes()
    buf = _scratch("inflate", min(step, n))
    pos = 0
    try:
        with _decompressor().stream_reader(payload) as reader:
            while pos < n:
                got = reader.readinto(buf[: min(step, n - pos)])
                if not got:
                    raise DeltaError(f"xor payload ends after {pos} of {n} bytes")
                sink(pos, buf[:got])
                pos += got
            if reader.read(1):
                raise DeltaError(f"xor payload is longer than the {n}-byte tensor")
    except zstandard.ZstdError as e:
        raise DeltaError(f"cannot decompress the zstd payload ({e})") from None


def _pread_exact(fd: int, out: np.ndarray, offset: int) -> None:
    got = os.preadv(fd, [out], offset)
    if got != out.size:
        raise DeltaError(f"short read: {got} of {out.size} bytes at offset {offset}")


def write_at(fd: int, data: np.ndarray, offset: int) -> None:
    """pwrite all of the uint8 array `data` at `offset` of the open file `fd`."""
    view = memoryview(data).cast("B")
    while view:
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


def apply_tensor_at(
    encoding: str, payload, fd: int, offset: int, nbytes: int, *, checksum_format: str | None = None
) -> str | None:
    """`apply_tensor` to the `nbytes` bytes at `offset` of the open file `fd` (read-write), through pread/pwrite of
    per-thread chunks (thread-safe: explicit offsets). Not mmap: a write fault per 4 KiB page of a file whose page
    cache holds small pages (e.g. one made by copy_file_range) costs ~8x the copy. A payload found bad midway may
    leave the region partly changed."""
    check_encoding(encoding)
    if encoding == "overwrite" or nbytes == 0:
        region = _scratch("region", nbytes)
        if nbytes:
            _pread_exact(fd, region, offset)
        digest = apply_tensor(encoding, payload, region, checksum_format=checksum_format)
        if nbytes:
            write_at(fd, region, offset)
        return digest
    hasher = new_hasher(checksum_format) if checksum_format else None
    region = _scratch("region", min(_chunk_bytes(), nbytes))

    def sink(pos: int, delta: np.ndarray) -> None:
        chunk = region[: delta.size]
        _pread_exact(fd, chunk, offset + pos)
        np.bitwise_xor(chunk, delta, out=chunk)
        if hasher is not None:
            hasher.update(chunk)
        write_at(fd, chunk, offset + pos)

    _xor_stream(payload, nbytes, sink)
    return hasher.hexdigest() if hasher is not None else None


def decode_tensor(encoding: str, payload, old, *, checksum_format: str | None = None) -> tuple[np.ndarray, str | None]:
    """The new bytes (a fresh array; `old` is untouched) and their checksum, from `old` and one payload."""
    out = np.array(_as_u8(old, "old"), copy=True)
    digest = apply_tensor(encoding, payload, out, checksum_format=checksum_format)
    return out, digest
