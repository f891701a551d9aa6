"""Published weight versions on disk: the format of docs/weight-format.md#layout, and the trainer-side publisher.

A disk dir holds one directory per published version, `weight_v{N:06d}/`, each an HF-style checkpoint with a
`model.safetensors.index.json` (`{"metadata": {...}, "weight_map": {name: file}}`):

- **full**: `model-0000i-of-0000k.safetensors` shards holding every tensor in the engine dtype; index metadata
  `total_size`, `version`, `checksum_format`, `chain_id`; each shard's `__metadata__` = `{"format": "pt",
  name: checksum of its bytes, ...}`. Also config/tokenizer files when the publisher is given them. Any HF
  checkpoint (single `model.safetensors`, no delta_encoding) reads as full.
- **delta** (index metadata has `delta_encoding`): index metadata `version`, `base_version` (= version - 1;
  both 6-digit strings), `delta_encoding` (`xor`|`overwrite`), `compression_format` (`zstd`),
  `checksum_format` (`xxh3-128`|`blake3`|`adler32`), `chain_id`; the weight_map names only the changed
  tensors; each shard stores one 1-D uint8 tensor per changed name holding its zstd payload (lichen.weights.delta_codec)
  and its `__metadata__` maps each name to the checksum of the tensor's new bytes. An unchanged model publishes
  an empty delta (no shards, empty weight_map).

`chain_id` (ignored by SGLang) names the chain a version belongs to: a publisher starts a new chain at its first
full version, so engines can tell a resumed run's version N from a dead run's version N.

Writes are atomic: a version is written into the hidden sibling `.weight_v{N:06d}.tmp-<pid>`, every file and
the directory fsynced, then renamed to `weight_v{N:06d}`; a crash leaves no half version under the real name.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import safetensors.numpy
import safetensors.torch
import torch

from lichen.weights import diff_kernel
from lichen.weights.delta_codec import (
    COMPRESSION_FORMAT,
    DeltaError,
    check_checksum_format,
    check_encoding,
    checksum,
    encode_tensor_cast,
    tensor_bytes,
)
from lichen.weights.hf_io import INDEX_FILE, SINGLE_FILE, _fsync_dir, _fsync_file, _write_json, write_side_files
from lichen.weights.parallel import default_threads, parallel_map

VERSION_PREFIX = "weight_v"
_VERSION_RE = re.compile(r"^weight_v(\d{6,})$")
_TMP_RE = re.compile(r"^\.weight_v\d{6,}\.(tmp|old)-\d+$")


def version_dir(disk_dir: str, version: int) -> str:
    """`<disk_dir>/weight_v{version:06d}`."""
    return os.path.join(disk_dir, f"{VERSION_PREFIX}{version:06d}")


def list_versions(disk_dir: str) -> list[int]:
    """The published version numbers under `disk_dir`, ascending ([] when it does not exist)."""
    if not os.path.isdir(disk_dir):
        return []
    found = (_VERSION_RE.match(name) for name in os.listdir(disk_dir))
    return sorted(int(m.group(1)) for m in found if m and os.path.isdir(os.path.join(disk_dir, m.group(0))))


@dataclass(frozen=True)
class VersionInfo:
    """What a version directory's index says. For a full version without an index, version comes from the
    directory name and the other fields are None; weight_map is then empty."""

    path: str
    version: int | None
    is_delta: bool
    base_version: int | None
    delta_encoding: str | None
    compression_format: str | None
    checksum_format: str | None
    chain_id: str | None
    weight_map: dict[str, str] = field(default_factory=dict)


def read_version_info(path: str) -> VersionInfo:
    """Parse a version directory. Raises FileNotFoundError for a missing directory and DeltaError for one that
    is neither an indexed checkpoint nor a lone `model.safetensors` (e.g. a delta whose index is not there)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"published weight version {path!r} does not exist")
    m = _VERSION_RE.match(os.path.basename(os.path.normpath(path)))
    dir_version = int(m.group(1)) if m else None
    index_path = os.path.join(path, INDEX_FILE)
    if not os.path.isfile(index_path):
        shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if shards != [SINGLE_FILE]:
            raise DeltaError(
                f"{path}: no {INDEX_FILE}; a version without an index must be a full checkpoint "
                f"with a single {SINGLE_FILE} (found: {', '.join(shards) or 'no weights'})"
            )
        return VersionInfo(path, dir_version, False, None, None, None, None, None)
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
        meta = index.get("metadata") or {}
        weight_map = dict(index.get("weight_map") or {})
        is_delta = "delta_encoding" in meta
        version = int(meta["version"]) if "version" in meta else dir_version
        base = int(meta["base_version"]) if is_delta else None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DeltaError(f"{index_path}: damaged index ({type(e).__name__}: {e})") from None
    if dir_version is not None and version != dir_version:
        raise DeltaError(f"{index_path}: metadata version {version} does not match the directory name")
    return VersionInfo(
        path,
        version,
        is_delta,
        base,
        meta.get("delta_encoding"),
        meta.get("compression_format"),
        meta.get("checksum_format"),
        meta.get("chain_id"),
        weight_map,
    )


def read_safetensors_header(path: str) -> tuple[int, dict]:
    """(header length, parsed header) of a safetensors file; tensor data starts at byte 8 + header length."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise DeltaError(f"{path}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", head)
        raw = f.read(n)
    if len(raw) != n:
        raise DeltaError(f"{path}: truncated safetensors header")
    try:
        return n, json.loads(raw)
    except ValueError as e:
        raise DeltaError(f"{path}: unreadable safetensors header ({e})") from None


def newest_full_version(disk_dir: str, at_or_below: int | None = None) -> int | None:
    """The newest full version under `disk_dir` (at or below `at_or_below` when given), or None."""
    for v in reversed(list_versions(disk_dir)):
        if at_or_below is not None and v > at_or_below:
            continue
        if not read_version_info(version_dir(disk_dir, v)).is_delta:
            return v
    return None


def version_tmp_dir(disk_dir: str, version: int) -> str:
    """A fresh, empty hidden directory in `disk_dir` to write version `version` in before `install_version`."""
    os.makedirs(disk_dir, exist_ok=True)
    tmp = os.path.join(disk_dir, f".{VERSION_PREFIX}{version:06d}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def install_version(tmp: str, disk_dir: str, version: int) -> str:
    """Make the fully written `tmp` version `version` of `disk_dir`: its files and itself fsynced (a file its
    writer fsynced already costs a system call), a version of that number left by an earlier run deleted, then
    renamed into place, so a reader sees the whole version or none of it. Returns the version's path."""
    for fname in os.listdir(tmp):
        _fsync_file(os.path.join(tmp, fname))
    _fsync_dir(tmp)
    final = version_dir(disk_dir, version)
    if os.path.exists(final):
        delete_versions(disk_dir, [version])
    os.rename(tmp, final)
    _fsync_dir(disk_dir)
    return final


def delete_versions(disk_dir: str, versions: list[int]) -> None:
    """Remove version directories: renamed to a hidden name first, so a reader never sees a half-deleted one."""
    for v in versions:
        path = version_dir(disk_dir, v)
        doomed = os.path.join(disk_dir, f".{VERSION_PREFIX}{v:06d}.old-{os.getpid()}")
        try:
            os.rename(path, doomed)
        except FileNotFoundError:
            continue
        shutil.rmtree(doomed, ignore_errors=True)


def remove_stale_versions(disk_dir: str, version: int) -> list[int]:
    """At a chain start: half-written versions of crashed processes, and versions newer than the new chain's
    first one `version` (left by an earlier run; a late joiner must never take them for this chain's)."""
    for name in os.listdir(disk_dir):
        if _TMP_RE.match(name):
            shutil.rmtree(os.path.join(disk_dir, name), ignore_errors=True)
    stale = [v for v in list_versions(disk_dir) if v > version]
    delete_versions(disk_dir, stale)
    return stale


@dataclass(frozen=True)
class PublishResult:
    """One published version. Byte counts are engine-dtype bytes; wire_bytes is the size of the files written
    (weights + index); changed_bytes (bytes that differ from the previous version) is None for a full version."""

    version: int
    kind: str  # "full" | "delta"
    path: str
    base_version: int | None
    reason: str  # why full, or "delta"
    num_tensors: int
    num_published: int  # tensors in the version's weight_map
    total_bytes: int
    changed_bytes: int | None
    wire_bytes: int
    seconds: float
    deleted: list[int]


class VersionPublisher:
    """Publishes the trainer's weights as versions under `disk_dir` (the trainer side of disk sync).

    mode "full" writes every version in full. mode "delta" keeps a CPU snapshot of the engine-dtype bytes of
    the last published version and publishes only the tensors that changed since, encoded with `encoding`;
    a version is full instead when: it is the first one of this publisher (a start or resume: a new chain),
    `full_interval` > 0 and `full_interval` - 1 deltas followed the last full one (so a full every
    `full_interval` syncs), the version is not last + 1, the tensor names/shapes/dtypes changed, or the
    previous publish failed. Unless `keep_files`, publishing a full version N deletes every version < N; a
    chain start also removes stale versions >= N left by an earlier run.

    `dtype` is the engine dtype floating-point tensors are cast to (None keeps each tensor's dtype).
    `config`/`copy_files_from` add config.json / tokenizer files to full versions (as save_hf_checkpoint).
    `post_write_hook(path)` runs after each version is in place (e.g. to flush an object-store mount).
    """

    def __init__(
        self,
        disk_dir: str,
        *,
        mode: str = "delta",
        encoding: str = "xor",
        checksum_format: str = "xxh3-128",
        full_interval: int = 0,
        keep_files: bool = False,
        dtype: torch.dtype | None = None,
        level: int = 1,
        max_shard_bytes: int = 5 * 1024**3,
        config: dict | None = None,
        copy_files_from: str | None = None,
        post_write_hook: Callable[[str], None] | None = None,
        num_threads: int | None = None,
    ):
        if mode not in ("full", "delta"):
            raise ValueError(f"unknown update-weight mode {mode!r}; expected 'full' or 'delta'")
        if full_interval < 0:
            raise ValueError(f"full_interval must be >= 0 (0: only the first version is full), got {full_interval}")
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.disk_dir = os.path.abspath(disk_dir)
        self.mode, self.encoding = mode, check_encoding(encoding)
        self.checksum_format = check_checksum_format(checksum_format)
        self.full_interval, self.keep_files, self.dtype, self.level = full_interval, keep_files, dtype, level
        self.max_shard_bytes, self.config, self.copy_files_from = max_shard_bytes, config, copy_files_from
        self.post_write_hook = post_write_hook
        self.num_threads = num_threads or default_threads()
        self.last_version: int | None = None
        self.chain_id: str | None = None
        self._snapshot: dict[str, torch.Tensor] | None = None  # engine-dtype CPU copies of the last version
        self._deltas_since_full = 0
        if mode == "delta" and self.encoding == "xor":  # compile or load the kernel before the first delta
            threading.Thread(target=diff_kernel.warm, name="lichen-diff-kernel-warm", daemon=True).start()

    def reset(self) -> None:
        """Forget the snapshot: the next version is full and starts a new chain (as after a resume)."""
        self._snapshot, self.last_version, self.chain_id, self._deltas_since_full = None, None, None, 0

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> PublishResult:
        """Publish `state_dict` as `weight_v{version:06d}` (full or delta, see the class doc)."""
        if not isinstance(version, int) or version < 1:
            raise ValueError(f"published versions start at 1, got {version!r}")
        if self.last_version is not None and version <= self.last_version:
            raise ValueError(f"version {version} is not after the last published version {self.last_version}")
        for name, t in state_dict.items():
            if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                raise TypeError(f"state_dict entries must be str -> torch.Tensor; got {name!r} -> {type(t).__name__}")
        t0 = time.perf_counter()
        reason = self._full_reason(state_dict, version)
        chain_start = self.chain_id is None
        if chain_start:
            self.chain_id = uuid.uuid4().hex
        os.makedirs(self.disk_dir, exist_ok=True)
        deleted = self._remove_stale(version) if chain_start else []
        tmp = version_tmp_dir(self.disk_dir, version)
        try:
            if reason:
                num_published, changed = self._write_full(state_dict, tmp, version), None
            else:
                num_published, changed = self._write_delta(state_dict, tmp, version)
            wire = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp))
            final = install_version(tmp, self.disk_dir, version)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            self.reset()  # the snapshot may have moved past what engines can reach: restart with a full version
            raise
        self.last_version = version
        self._deltas_since_full = 0 if reason else self._deltas_since_full + 1
        if self.post_write_hook is not None:
            self.post_write_hook(final)
        if reason and not self.keep_files:
            older = [v for v in list_versions(self.disk_dir) if v < version]
            delete_versions(self.disk_dir, older)
            deleted = sorted(deleted + older)
        total = sum(_engine_nbytes(t, self.dtype) for t in state_dict.values())
        return PublishResult(
            version,
            "full" if reason else "delta",
            final,
            None if reason else version - 1,
            reason or "delta",
            len(state_dict),
            num_published,
            total,
            changed,
            wire,
            time.perf_counter() - t0,
            deleted,
        )

    def _full_reason(self, state_dict: Mapping[str, torch.Tensor], version: int) -> str:
        if self.mode == "full":
            return "mode full"
        if self._snapshot is None:
            return "first version of a chain"
        if version != self.last_version + 1:
            return f"version {version} does not follow {self.last_version}"
        if self.full_interval and self._deltas_since_full >= self.full_interval - 1:
            return f"full interval {self.full_interval}"
        snap = self._snapshot
        if list(snap) != list(state_dict) or any(
            snap[k].shape != v.shape or snap[k].dtype != _engine_dtype(v, self.dtype) for k, v in state_dict.items()
        ):
            return "tensor names, shapes or dtypes changed"
        return ""

    def _remove_stale(self, version: int) -> list[int]:
        return remove_stale_versions(self.disk_dir, version)

    def _write_full(self, state_dict: Mapping[str, torch.Tensor], dst: str, version: int) -> int:
        names = list(state_dict)
        shards: list[list[str]] = [[]]
        used = 0
        for name in names:  # greedy in state-dict order; an oversized tensor gets a shard of its own
            size = _engine_nbytes(state_dict[name], self.dtype)
            if shards[-1] and used + size > self.max_shard_bytes:
                shards.append([])
                used = 0
            shards[-1].append(name)
            used += size
        keep = self.mode == "delta"
        snapshot: dict[str, torch.Tensor] = {}
        weight_map: dict[str, str] = {}
        total = 0
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            copies = {n: _engine_copy(state_dict[n], self.dtype) for n in shard}
            sums = parallel_map(
                lambda n: checksum(self.checksum_format, tensor_bytes(copies[n])), shard, self.num_threads
            )
            header = {"format": "pt", **dict(zip(shard, sums))}
            safetensors.torch.save_file(copies, os.path.join(dst, fname), metadata=header)
            total += sum(t.numel() * t.element_size() for t in copies.values())
            weight_map.update({n: fname for n in shard})
            if keep:
                snapshot.update(copies)
        _write_json(
            os.path.join(dst, INDEX_FILE),
            {
                "metadata": {
                    "total_size": total,
                    "version": f"{version:06d}",
                    "checksum_format": self.checksum_format,
                    "chain_id": self.chain_id,
                },
                "weight_map": weight_map,
            },
        )
        write_side_files(dst, config=self.config, copy_files_from=self.copy_files_from)
        self._snapshot = {n: snapshot[n] for n in names} if keep else None
        return len(names)

    def _write_delta(self, state_dict: Mapping[str, torch.Tensor], dst: str, version: int) -> tuple[int, int]:
        snap = self._snapshot
        assert snap is not None
        names = list(state_dict)
        # The snapshot advances as tensors are encoded; a failure after this point resets the publisher.
        encoded = parallel_map(
            lambda n: encode_tensor_cast(
                self.encoding,
                state_dict[n],
                tensor_bytes(snap[n]),
                snap[n].dtype,
                checksum_format=self.checksum_format,
                level=self.level,
            ),
            names,
            self.num_threads,
        )
        changed = {n: e for n, e in zip(names, encoded) if e is not None}
        shards: list[list[str]] = []
        used = 0
        for name, e in changed.items():
            if not shards or (shards[-1] and used + len(e.payload) > self.max_shard_bytes):
                shards.append([])
                used = 0
            shards[-1].append(name)
            used += len(e.payload)
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            arrays = {n: np.frombuffer(changed[n].payload, dtype=np.uint8) for n in shard}
            safetensors.numpy.save_file(
                arrays, os.path.join(dst, fname), metadata={n: changed[n].checksum for n in shard}
            )
            weight_map.update({n: fname for n in shard})
        _write_json(
            os.path.join(dst, INDEX_FILE),
            {
                "metadata": {
                    "version": f"{version:06d}",
                    "base_version": f"{version - 1:06d}",
                    "delta_encoding": self.encoding,
                    "compression_format": COMPRESSION_FORMAT,
                    "checksum_format": self.checksum_format,
                    "chain_id": self.chain_id,
                },
                "weight_map": weight_map,
            },
        )
        return len(changed), sum(e.changed_bytes for e in changed.values())


def _engine_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if (dtype is not None and t.is_floating_point()) else t.dtype


def _engine_nbytes(t: torch.Tensor, dtype: torch.dtype | None) -> int:
    return t.numel() * torch.empty((), dtype=_engine_dtype(t, dtype)).element_size()


def _engine_view(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The tensor in the engine dtype, on CPU, contiguous: no copy when it already is (read-only use)."""
    return t.detach().to(device="cpu", dtype=_engine_dtype(t, dtype)).contiguous()


def _engine_copy(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """Like _engine_view but always a tensor of its own (the snapshot must not alias the trainer's weights,
    and tied weights must not share storage in a safetensors file)."""
    out = _engine_view(t, dtype)
    if out.device == t.device and out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
        out = out.clone()
    return out
