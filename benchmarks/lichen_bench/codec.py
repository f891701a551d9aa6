"""`bench_delta`: size and speed of a full weight version against a delta of it, in memory.

Measures lichen.weights.delta_codec on random weights where a fraction moves by one unit in the last place; the
`lichen bench sync` suite measures the same on a real model and through the transports.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from lichen.weights.delta_codec import (
    apply_tensor,
    check_checksum_format,
    check_encoding,
    checksum,
    encode_tensor,
    tensor_bytes,
)
from lichen.weights.parallel import parallel_map


def perturb(t: torch.Tensor, fraction: float, gen: torch.Generator) -> torch.Tensor:
    """A copy of `t` with ~`fraction` of its elements moved by one unit in the last place (the typical change of
    a low-precision weight under one small optimizer step): flip the lowest bit of the element's integer view."""
    int_dtype = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    out = t.clone()
    bits = out.view(int_dtype)
    mask = torch.rand(t.shape, generator=gen) < fraction
    bits[mask] ^= 1
    return out


def bench_delta(
    num_params: int,
    changed_fraction: float,
    *,
    dtype: torch.dtype = torch.bfloat16,
    encoding: str = "xor",
    checksum_format: str = "xxh3-128",
    level: int = 1,
    tensor_params: int = 1 << 22,
    num_threads: int | None = None,
    seed: int = 0,
) -> dict:
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
    new = [perturb(t, changed_fraction, gen) for t in old]
    snapshot = [tensor_bytes(t.clone()) for t in old]

    t0 = time.perf_counter()
    blob = safetensors.torch.save({f"w{i}": t for i, t in enumerate(new)})
    parallel_map(lambda t: checksum(checksum_format, tensor_bytes(t)), new, num_threads)
    full_seconds = time.perf_counter() - t0

    t0 = time.perf_counter()
    encoded = parallel_map(
        lambda i: encode_tensor(
            encoding, tensor_bytes(new[i]), snapshot[i], checksum_format=checksum_format, level=level, update_old=True
        ),
        range(len(new)),
        num_threads,
    )
    encode_seconds = time.perf_counter() - t0

    targets = [tensor_bytes(t.clone()) for t in old]
    t0 = time.perf_counter()
    digests = parallel_map(
        lambda i: (
            None
            if encoded[i] is None
            else apply_tensor(encoding, encoded[i].payload, targets[i], checksum_format=checksum_format)
        ),
        range(len(new)),
        num_threads,
    )
    apply_seconds = time.perf_counter() - t0
    for i, t in enumerate(new):
        if not np.array_equal(targets[i], tensor_bytes(t)) or (
            encoded[i] is not None and digests[i] != encoded[i].checksum
        ):
            raise AssertionError(f"bench_delta: tensor {i} did not round-trip")

    total = sum(t.numel() * t.element_size() for t in new)
    delta_bytes = sum(len(e.payload) for e in encoded if e is not None)
    return {
        "num_params": num_params,
        "changed_fraction": changed_fraction,
        "dtype": str(dtype).replace("torch.", ""),
        "encoding": encoding,
        "checksum_format": checksum_format,
        "engine_bytes": total,
        "changed_bytes": sum(e.changed_bytes for e in encoded if e is not None),
        "full_bytes": len(blob),
        "delta_bytes": delta_bytes,
        "delta_ratio": delta_bytes / max(len(blob), 1),
        "full_seconds": full_seconds,
        "encode_seconds": encode_seconds,
        "apply_seconds": apply_seconds,
        "encode_bytes_per_s": total / max(encode_seconds, 1e-9),
        "apply_bytes_per_s": total / max(apply_seconds, 1e-9),
    }
