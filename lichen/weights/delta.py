"""The per-tensor weight delta codec: encode, apply, verify (the payloads of `sglang-api.md` §5.6).

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

Encoding and applying stream each tensor in `CHUNK_BYTES` pieces (xor, count, compress and hash one piece while
it is in cache), so memory stays at one piece per thread besides the tensors themselves. zstd, numpy ufuncs and
the hashes release the GIL, so a thread pool over tensors uses every core.

This module is a leaf: torch, numpy, zstandard, xxhash, blake3 and the standard library only.
"""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import blake3
import numpy as np
import torch
import xxhash
import zstandard

ENCODINGS = ("xor", "overwrite")
CHECKSUM_FORMATS = ("xxh3-128", "blake3", "adler32")
COMPRESSION_FORMAT = "zstd"
CHUNK_BYTES = 2 << 20
_U32_LIMIT = 1 << 32

T = TypeVar("T")
R = TypeVar("R")


class DeltaError(RuntimeError):
    """A delta or version that cannot be applied: malformed payload, wrong size, missing file or checksum."""


class ChecksumMismatchError(DeltaError):
    """The bytes after applying (or copying) a tensor do not hash to the checksum its version recorded."""

    def __init__(self, mismatches: list[tuple[str, str]], where: str):
        self.mismatches = mismatches  # (tensor name, file)
        shown = "; ".join(f"tensor {n!r} in {f}" for n, f in mismatches[:10])
        more = f" (and {len(mismatches) - 10} more)" if len(mismatches) > 10 else ""
        super().__init__(f"checksum mismatch for {len(mismatches)} tensor(s) after applying {where}: {shown}{more}."
                         " The published files or the local copy are corrupt; the version was not applied.")


class VersionMismatchError(DeltaError):
    """A delta whose base version is not the version the target holds (out of order, or another chain)."""


def check_encoding(encoding: str) -> str:
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown delta encoding {encoding!r}; expected one of {', '.join(ENCODINGS)}")
    return encoding


def check_checksum_format(checksum_format: str) -> str:
    if checksum_format not in CHECKSUM_FORMATS:
        raise ValueError(f"unknown checksum format {checksum_format!r}; "
                         f"expected one of {', '.join(CHECKSUM_FORMATS)}")
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


def encode_tensor(encoding: str, new, old, *, checksum_format: str | None = None, level: int = 1,
                  update_old: bool = False) -> EncodedTensor | None:
    """The delta payload taking bytes `old` to bytes `new` (equal lengths), or None when they are identical.

    With `update_old`, `old` is overwritten with `new` where they differ (the snapshot then equals `new`),
    in the same pass. `checksum_format` adds the checksum of `new`. `level` is the zstd level.
    """
    check_encoding(encoding)
    new, old = _as_u8(new, "new"), _as_u8(old, "old")
    if new.size != old.size:
        raise ValueError(f"new and old bytes differ in length: {new.size} vs {old.size}")
    if update_old and not old.flags.writeable:
        raise ValueError("update_old needs a writable old array")
    n = new.size
    if encoding == "overwrite" and n > _U32_LIMIT:
        raise DeltaError(f"overwrite deltas address bytes with u32 offsets; a tensor of {n} bytes is too large "
                         "(use the xor encoding)")
    hasher = new_hasher(checksum_format) if checksum_format else None
    buf = np.empty(min(CHUNK_BYTES, n), dtype=np.uint8)
    changed = 0
    parts: list[bytes] = []
    positions: list[np.ndarray] = []
    values: list[np.ndarray] = []
    cobj = zstandard.ZstdCompressor(level=level).compressobj(size=n) if encoding == "xor" else None
    for start in range(0, n, CHUNK_BYTES):
        stop = min(start + CHUNK_BYTES, n)
        new_c, old_c, diff = new[start:stop], old[start:stop], buf[: stop - start]
        np.bitwise_xor(new_c, old_c, out=diff)
        count = int(np.count_nonzero(diff))
        if cobj is not None:
            parts.append(cobj.compress(diff))
        elif count:
            idx = np.flatnonzero(diff)
            positions.append((idx + start).astype("<u4"))
            values.append(new_c[idx])
        if hasher is not None:
            hasher.update(new_c)
        if count:
            changed += count
            if update_old:
                np.copyto(old_c, new_c)
    if not changed:
        return None
    if cobj is not None:
        parts.append(cobj.flush())
        payload = b"".join(parts)
    else:
        raw = b"".join([changed.to_bytes(4, "little"), *(p.tobytes() for p in positions),
                        *(v.tobytes() for v in values)])
        payload = zstandard.ZstdCompressor(level=level).compress(raw)
    return EncodedTensor(payload, changed, hasher.hexdigest() if hasher is not None else None)


def _decompress_all(payload) -> bytes:
    try:
        size = zstandard.frame_content_size(payload)
        if size >= 0:
            return zstandard.ZstdDecompressor().decompress(payload)
        return zstandard.ZstdDecompressor().decompressobj().decompress(bytes(payload))
    except zstandard.ZstdError as e:
        raise DeltaError(f"cannot decompress the zstd payload ({e})") from None


def apply_tensor(encoding: str, payload, target, *, checksum_format: str | None = None) -> str | None:
    """Apply one payload to the bytes `target` in place; return the checksum of the result (None without
    `checksum_format`). Raises DeltaError for a payload that does not fit `target` (wrong size, bad frame,
    offsets out of range); a xor payload found bad midway may leave `target` partly changed."""
    check_encoding(encoding)
    target = _as_u8(target, "target")
    if not target.flags.writeable:
        raise ValueError("apply_tensor needs a writable target array")
    n = target.size
    hasher = new_hasher(checksum_format) if checksum_format else None
    if encoding == "xor":
        _apply_xor(payload, target, hasher)
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
        target[pos] = raw[4 + 4 * count:]
        if hasher is not None:
            hasher.update(target)
    return hasher.hexdigest() if hasher is not None else None


def _apply_xor(payload, target: np.ndarray, hasher) -> None:
    n = target.size
    try:
        declared = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as e:
        raise DeltaError(f"not a zstd frame ({e})") from None
    if declared >= 0 and declared != n:
        raise DeltaError(f"xor payload decodes to {declared} bytes but the tensor holds {n}")
    buf = np.empty(min(CHUNK_BYTES, n), dtype=np.uint8)
    pos = 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(payload) as reader:
            while pos < n:
                got = reader.readinto(buf[: min(CHUNK_BYTES, n - pos)])
                if not got:
                    raise DeltaError(f"xor payload ends after {pos} of {n} bytes")
                region = target[pos: pos + got]
                np.bitwise_xor(region, buf[:got], out=region)
                if hasher is not None:
                    hasher.update(region)
                pos += got
            if reader.read(1):
                raise DeltaError(f"xor payload is longer than the {n}-byte tensor")
    except zstandard.ZstdError as e:
        raise DeltaError(f"cannot decompress the zstd payload ({e})") from None


def decode_tensor(encoding: str, payload, old, *, checksum_format: str | None = None) -> tuple[np.ndarray, str | None]:
    """The new bytes (a fresh array; `old` is untouched) and their checksum, from `old` and one payload."""
    out = np.array(_as_u8(old, "old"), copy=True)
    digest = apply_tensor(encoding, payload, out, checksum_format=checksum_format)
    return out, digest


def default_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def parallel_map(fn: Callable[[T], R], items: Iterable[T], num_threads: int | None = None) -> list[R]:
    """`[fn(x) for x in items]` on a thread pool (in order); plain loop for one thread."""
    items = list(items)
    threads = min(num_threads or default_threads(), len(items))
    if threads <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(fn, items))


def _perturb(t: torch.Tensor, fraction: float, gen: torch.Generator) -> torch.Tensor:
    """A copy of `t` with ~`fraction` of its elements moved by one unit in the last place (the typical change of
    a low-precision weight under one small optimizer step): flip the lowest bit of the element's integer view."""
    int_dtype = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    out = t.clone()
    bits = out.view(int_dtype)
    mask = torch.rand(t.shape, generator=gen) < fraction
    bits[mask] ^= 1
    return out


def bench_delta(num_params: int, changed_fraction: float, *, dtype: torch.dtype = torch.bfloat16,
                encoding: str = "xor", checksum_format: str = "xxh3-128", level: int = 1,
                tensor_params: int = 1 << 22, num_threads: int | None = None, seed: int = 0) -> dict:
    """Size and speed of a full version against a delta, in memory (no disk), for `num_params` random weights
    (N(0, 0.02²) in `dtype`, split into tensors of `tensor_params`) of which a random `changed_fraction` move
    by one ulp.

    Returns engine-dtype byte counts and seconds:
      full_bytes   = serialized safetensors size of all tensors; full_seconds = serialize + checksum;
      delta_bytes  = sum of payload sizes; encode_seconds = diff + compress + checksum + snapshot update;
      apply_seconds = decompress + apply + checksum into a copy of the old bytes (checked bit-exact);
      changed_bytes, delta_ratio = delta_bytes / full_bytes, and throughputs in bytes per second.
    """
    import safetensors.torch

    check_encoding(encoding)
    check_checksum_format(checksum_format)
    gen = torch.Generator().manual_seed(seed)
    sizes = [min(tensor_params, num_params - i) for i in range(0, num_params, tensor_params)]
    old = [(torch.randn(s, generator=gen) * 0.02).to(dtype) for s in sizes]
    new = [_perturb(t, changed_fraction, gen) for t in old]
    snapshot = [tensor_bytes(t.clone()) for t in old]

    t0 = time.perf_counter()
    blob = safetensors.torch.save({f"w{i}": t for i, t in enumerate(new)})
    parallel_map(lambda t: checksum(checksum_format, tensor_bytes(t)), new, num_threads)
    full_seconds = time.perf_counter() - t0

    t0 = time.perf_counter()
    encoded = parallel_map(lambda i: encode_tensor(encoding, tensor_bytes(new[i]), snapshot[i],
                                                   checksum_format=checksum_format, level=level, update_old=True),
                           range(len(new)), num_threads)
    encode_seconds = time.perf_counter() - t0

    targets = [tensor_bytes(t.clone()) for t in old]
    t0 = time.perf_counter()
    digests = parallel_map(lambda i: None if encoded[i] is None else
                           apply_tensor(encoding, encoded[i].payload, targets[i], checksum_format=checksum_format),
                           range(len(new)), num_threads)
    apply_seconds = time.perf_counter() - t0
    for i, t in enumerate(new):
        if not np.array_equal(targets[i], tensor_bytes(t)) or (
                encoded[i] is not None and digests[i] != encoded[i].checksum):
            raise AssertionError(f"bench_delta: tensor {i} did not round-trip")

    total = sum(t.numel() * t.element_size() for t in new)
    delta_bytes = sum(len(e.payload) for e in encoded if e is not None)
    return {
        "num_params": num_params, "changed_fraction": changed_fraction, "dtype": str(dtype).replace("torch.", ""),
        "encoding": encoding, "checksum_format": checksum_format, "engine_bytes": total,
        "changed_bytes": sum(e.changed_bytes for e in encoded if e is not None),
        "full_bytes": len(blob), "delta_bytes": delta_bytes, "delta_ratio": delta_bytes / max(len(blob), 1),
        "full_seconds": full_seconds, "encode_seconds": encode_seconds, "apply_seconds": apply_seconds,
        "encode_bytes_per_s": total / max(encode_seconds, 1e-9), "apply_bytes_per_s": total / max(apply_seconds, 1e-9),
    }
