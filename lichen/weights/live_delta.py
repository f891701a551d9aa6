"""Read a delta version's payloads and apply them to live tensors (an engine that moves its loaded weights
instead of reloading a checkpoint).

`delta_payloads` checks a delta version's format and returns each tensor's zstd payload with the checksum of its
new bytes (lichen.weights.pull applies them to a host-local checkpoint file). `apply_delta_to_tensors` (any
device; every checksum verified before any tensor changes) and `apply_delta_in_place` (CPU parameters changed in
one pass) apply them to the parameters an engine serves. The format: docs/weight-format.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from lichen.weights.delta_codec import (
    COMPRESSION_FORMAT,
    ChecksumMismatchError,
    DeltaError,
    VersionMismatchError,
    apply_tensor,
    check_checksum_format,
    check_encoding,
    decode_tensor,
    tensor_bytes,
)
from lichen.weights.parallel import parallel_map
from lichen.weights.versions import VersionInfo, read_safetensors_header, read_version_info


def check_delta_meta(info: VersionInfo) -> None:
    if not info.is_delta:
        raise DeltaError(f"{info.path} is a full version, not a delta")
    check_encoding(info.delta_encoding)
    if info.compression_format != COMPRESSION_FORMAT:
        raise DeltaError(f"{info.path}: compression {info.compression_format!r} is not supported (only zstd)")
    check_checksum_format(info.checksum_format)


def delta_payloads(info: VersionInfo) -> tuple[list[tuple[str, str, memoryview, str]], int]:
    """([(tensor, delta file, zstd payload, checksum of its new bytes)], bytes read) of a delta version.
    Each shard must hold exactly the tensors the index maps to it, as 1-D uint8, each with a checksum."""
    check_delta_meta(info)
    by_file: dict[str, set[str]] = {}
    for name, fname in info.weight_map.items():
        by_file.setdefault(fname, set()).add(name)
    items, read = [], 0
    for fname, expected in sorted(by_file.items()):
        path = os.path.join(info.path, fname)
        if not os.path.isfile(path):
            raise DeltaError(f"{info.path}: the index names {fname}, which does not exist")
        with open(path, "rb") as f:
            blob = f.read()
        read += len(blob)
        n, header = read_safetensors_header(path)
        names = header.keys() - {"__metadata__"}
        if names != expected:
            raise DeltaError(
                f"{path}: holds tensors {sorted(names - expected)[:5]} the index does not map to it and "
                f"lacks {sorted(expected - names)[:5]}"
            )
        sums = header.get("__metadata__") or {}
        view = memoryview(blob)
        for name in sorted(names):
            meta = header[name]
            if meta.get("dtype") != "U8" or len(meta.get("shape", ())) != 1:
                raise DeltaError(f"{path}: delta of tensor {name!r} must be a 1-D U8 array, got {meta.get('dtype')}")
            if name not in sums:
                raise DeltaError(f"{path}: no checksum recorded for tensor {name!r} in the file's __metadata__")
            begin, end = meta["data_offsets"]
            items.append((name, path, view[8 + n + begin : 8 + n + end], sums[name]))
    return items, read


def apply_delta_to_tensors(
    tensors: Mapping[str, torch.Tensor],
    delta_dir: str,
    *,
    held_version: int | None,
    held_chain_id: str | None = None,
    num_threads: int | None = None,
) -> int:
    """Move live tensors (name -> tensor, any device) from `held_version` to the delta version in `delta_dir`.

    Every changed tensor's new bytes are computed and checked against its checksum first; only when all match
    are the tensors written, so on any error the tensors still hold `held_version`. Raises VersionMismatchError
    when the delta does not build on `held_version` (or on `held_chain_id`, when both chains are known).
    Returns the number of tensors changed."""
    info = read_version_info(delta_dir)
    check_delta_meta(info)
    if held_version != info.base_version:
        raise VersionMismatchError(
            f"out-of-order delta: {delta_dir} builds on version {info.base_version}, "
            f"but the engine holds {held_version}"
        )
    if info.chain_id is not None and held_chain_id is not None and held_chain_id != info.chain_id:
        raise VersionMismatchError(f"{delta_dir} belongs to another publishing chain than the engine's weights")
    items, _ = delta_payloads(info)
    missing = [name for name, *_ in items if name not in tensors]
    if missing:
        raise DeltaError(f"{delta_dir} changes tensor(s) {missing[:5]} that the engine does not hold")

    def decode_one(item):
        name, dfile, payload, want = item
        t = tensors[name]
        old = tensor_bytes(t.detach().to("cpu"))
        try:
            new, got = decode_tensor(info.delta_encoding, payload, old, checksum_format=info.checksum_format)
        except DeltaError as e:
            raise DeltaError(f"tensor {name!r} in {dfile}: {e}") from None
        return name, dfile, new, got == want

    decoded = parallel_map(decode_one, items, num_threads)
    bad = [(name, dfile) for name, dfile, _, ok in decoded if not ok]
    if bad:
        raise ChecksumMismatchError(bad, delta_dir)
    with torch.no_grad():
        for name, _, new, _ in decoded:
            t = tensors[name]
            src = torch.from_numpy(new).view(t.dtype).reshape(t.shape)
            t.copy_(src)
    return len(decoded)


def apply_delta_in_place(
    params: Mapping[str, torch.Tensor],
    delta_dir: str,
    *,
    held_version: int,
    chain_id: str | None,
    num_threads: int | None = None,
) -> int:
    """Move served parameters from `held_version` to the delta version in `delta_dir`; returns tensors changed.

    CPU parameters are changed in place (one pass over each changed tensor: decompress, apply, hash); a payload
    that does not apply or a checksum that does not match raises after the pass, with the parameters then in an
    unknown state: the caller reloads the verified local checkpoint. Parameters on an accelerator go through
    apply_delta_to_tensors (every checksum checked before any tensor is written)."""
    if any(p.device.type != "cpu" or not p.is_contiguous() for p in params.values()):
        return apply_delta_to_tensors(
            params, delta_dir, held_version=held_version, held_chain_id=chain_id, num_threads=num_threads
        )
    info = read_version_info(delta_dir)
    if info.base_version != held_version or (chain_id is not None and info.chain_id not in (None, chain_id)):
        raise VersionMismatchError(
            f"out-of-order delta: {delta_dir} builds on version {info.base_version} of chain "
            f"{info.chain_id}, the engine holds {held_version} of {chain_id}"
        )
    items, _ = delta_payloads(info)  # checks the encoding, compression and checksum format too
    missing = [name for name, *_ in items if name not in params]
    if missing:
        raise VersionMismatchError(f"{delta_dir} changes tensor(s) {missing[:5]} the engine does not hold")

    def one(item) -> tuple[str, str, str | None] | None:
        name, dfile, payload, want = item
        try:
            got = apply_tensor(
                info.delta_encoding, payload, tensor_bytes(params[name].data), checksum_format=info.checksum_format
            )
        except DeltaError as e:
            return name, dfile, str(e)
        return None if got == want else (name, dfile, None)

    with torch.no_grad():
        bad = [r for r in parallel_map(one, items, num_threads) if r is not None]
    broken = [f"tensor {name!r} in {dfile}: {err}" for name, dfile, err in bad if err is not None]
    if broken:
        raise DeltaError(f"cannot apply {delta_dir} to the live weights: " + "; ".join(broken[:10]))
    if bad:
        raise ChecksumMismatchError([(name, dfile) for name, dfile, _ in bad], delta_dir)
    return len(items)
