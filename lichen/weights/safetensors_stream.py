"""Writing one safetensors file tensor by tensor, never holding the file's tensors together.

`safetensors.torch.save_file` takes a dict of every tensor of the file; a multi-rank trainer's export would then
hold a whole file (for a model under the 5 GB shard size: the whole model) on rank 0. The format needs only the
names, dtypes and shapes up front (the header: 8-byte little-endian length, then JSON with each tensor's byte range
in the data that follows), so `write_streamed` writes the header from that metadata and each tensor's bytes as it
arrives. The file reads back with safetensors like one `save_file` wrote (the same tensors; the header lists
them in the order given, not save_file's).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable

import torch

# safetensors' dtype names (the format's spec)
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def write_streamed(
    path: str,
    rows: list[tuple[str, list[int], torch.dtype]],
    tensors: Iterable[tuple[str, torch.Tensor]],
    metadata: dict[str, str] | None = None,
) -> int:
    """Write `path` holding the tensors `rows` announces ((name, shape, dtype), in file order), their values taken
    from `tensors` one at a time, in the same order; returns the data bytes written. Raises ValueError when a
    tensor is not the one announced (name, shape or dtype)."""
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, shape, dtype in rows:
        if dtype not in _DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {dtype} has no safetensors name")
        n = 1
        for d in shape:
            n *= int(d)
        size = n * dtype.itemsize
        header[name] = {
            "dtype": _DTYPES[dtype],
            "shape": [int(d) for d in shape],
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    written = 0
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        it = iter(tensors)
        for name, shape, dtype in rows:
            got_name, t = next(it, (None, None))
            if got_name != name or t is None or list(t.shape) != [int(d) for d in shape] or t.dtype != dtype:
                raise ValueError(f"{path}: expected tensor {name!r} {list(shape)} {dtype}, got {got_name!r}")
            data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            f.write(data.numpy().data)  # the tensor's own bytes, no copy
            written += data.numel()
    if written != offset:
        raise ValueError(f"{path}: wrote {written} bytes of tensor data, announced {offset}")
    return written
