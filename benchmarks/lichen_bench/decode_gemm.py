"""The linear layers of one decode step of W2 (6 layers: q, k, v, o 512x512; gate, up 1536x512; down 512x1536;
82 MB of fp32 weights), one thread, at several live-row counts, four ways: torch's F.linear over the [out, in]
weights (what lichen's engine runs), the same weights stored transposed ([in, out]: `x @ Wt`), `(W @ x.T).T`, and
numpy's matmul (its own BLAS, OpenBLAS in the wheels). Prints milliseconds per step and the weight bytes per
second each reaches; the memory read bandwidth of the same thread (a sum over 256 MB) is the ceiling for few
rows, the matmul peak (`lichen bench rl`'s limits) for many.

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=benchmarks python -m lichen_bench.decode_gemm [--rows 1 4 16 64] [--repeats 20]

OPENBLAS_NUM_THREADS=1 keeps numpy's BLAS on one thread as torch is (it reads the variable at import).
docs/performance.md#decode-gemms-on-the-amd-epyc has a run.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable


def median_s(fn: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of `repeats` calls of `fn` after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def read_speed(mb: int = 256) -> float:
    """Bytes per second one thread reads memory at: the median of 5 sums over `mb` MB of float32."""
    import torch

    big = torch.randn(mb * 1024 * 1024 // 4)
    return big.numel() * 4 / median_s(lambda: big.sum(), 5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lichen_bench.decode_gemm", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64], help="live rows per step")
    p.add_argument("--repeats", type=int, default=20, help="timed steps per variant (median; default 20)")
    p.add_argument("--layers", type=int, default=6, help="decoder layers (default 6, W2's)")
    a = p.parse_args(argv)
    if a.repeats < 1 or a.layers < 1 or min(a.rows) < 1:
        p.error("--rows, --repeats and --layers must be at least 1")
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    torch.manual_seed(0)
    shapes = [(512, 512)] * 4 + [(1536, 512)] * 2 + [(512, 1536)]
    weights = [torch.randn(o, i) / i**0.5 for _ in range(a.layers) for (o, i) in shapes]
    transposed = [w.t().contiguous() for w in weights]
    as_numpy = [w.numpy() for w in weights]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    flops_per_row = sum(2 * w.numel() for w in weights)
    print(
        f"one thread: memory read {read_speed() / 1e9:.1f} GB/s (sum of 256 MB); weights {nbytes / 1e6:.1f} MB per step"
    )
    print(
        f"{'rows':>4}  "
        + "  ".join(f"{k:>24}" for k in ("F.linear (engine)", "x @ Wt", "(W @ x.T).T", "numpy x @ W.T"))
    )
    for m in a.rows:
        xs = [torch.randn(m, w.shape[1]) for w in weights]
        xn = [x.numpy() for x in xs]
        variants = [
            lambda: [F.linear(x, w) for x, w in zip(xs, weights)],
            lambda: [x @ w for x, w in zip(xs, transposed)],
            lambda: [(w @ x.t()).t() for x, w in zip(xs, weights)],
            lambda: [x @ w.T for x, w in zip(xn, as_numpy)],
        ]
        cells = []
        for fn in variants:
            s = median_s(fn, a.repeats)
            cells.append(f"{s * 1e3:6.2f} ms {nbytes / s / 1e9:5.1f} GB/s {m * flops_per_row / s / 1e9:5.1f} GF")
        print(f"{m:>4}  " + "  ".join(f"{c:>24}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
