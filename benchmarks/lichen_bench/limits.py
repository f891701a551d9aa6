"""Hardware limit and model FLOP counts, so each framework's speed can be read as a fraction of what the CPU does.

Useful FLOPs of one sequence with prompt length p and response length r (only unpadded, unfinished tokens):
the model must run positions 0 .. p + r - 2 (the last response token predicts nothing that is used) and the
LM head only at the r positions that predict a response token. Per layer and token at position t:
    linear:     2 * (h*q + 2*h*kv + q*h + 3*h*i)          (q, k, v, o projections; gate, up, down)
    attention:  4 * q * (t + 1)                          (QK^T and AV over the causal context, no padding)
LM head: 2 * h * V per predicting position. Norms, RoPE, softmax and the embedding lookup are not counted.
Training (forward + backward) counts 3x the forward, the usual approximation (backward ~ 2x forward).
"""

from __future__ import annotations

import time


def linear_flops_per_token(shape: dict) -> int:
    h, q, kv, i = shape["hidden"], shape["q_dim"], shape["kv_dim"], shape["intermediate"]
    return 2 * (h * q + 2 * h * kv + q * h + 3 * h * i) * shape["layers"]


def sequence_forward_flops(shape: dict, prompt_len: int, response_len: int) -> int:
    """Useful forward FLOPs of one sequence (see the module docstring)."""
    n = max(prompt_len + response_len - 1, 0)  # positions 0 .. n-1 are run
    attn = 4 * shape["q_dim"] * shape["layers"] * (n * (n + 1) // 2)  # sum over t of (t + 1)
    head = 2 * shape["hidden"] * shape["vocab"] * response_len
    return linear_flops_per_token(shape) * n + attn + head


def useful_tokens(prompt_len: int, response_len: int) -> int:
    """Positions a framework must run for one sequence: p + r - 1."""
    return max(prompt_len + response_len - 1, 0)


def batch_forward_flops(shape: dict, lengths: list[tuple[int, int]]) -> int:
    return sum(sequence_forward_flops(shape, p, r) for p, r in lengths)


def matmul_throughput(size: int = 2048, repeats: int = 20, threads: int | None = None) -> dict:
    """Best-of-`repeats` fp32 FLOP/s of a size x size x size matmul (2 * size**3 FLOPs per product).

    Best-of, over many short products: on a shared machine other work only ever slows a product down, so the
    fastest one is the closest to what the cores can do.
    """
    import torch

    if threads:
        torch.set_num_threads(threads)
    a = torch.randn(size, size, dtype=torch.float32)
    b = torch.randn(size, size, dtype=torch.float32)
    out = torch.empty(size, size, dtype=torch.float32)
    torch.mm(a, b, out=out)  # warm-up: thread pool, page faults
    best = float("inf")
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        dt = time.perf_counter() - t0
        times.append(dt)
        best = min(best, dt)
    flops = 2 * size**3
    return {
        "size": size,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "best_flops_per_s": flops / best,
        "median_flops_per_s": flops / sorted(times)[len(times) // 2],
    }
