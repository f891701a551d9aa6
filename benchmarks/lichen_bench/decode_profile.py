"""Where lichen's engine spends a decode-heavy generate: the requests of `lichen bench engines`' generation part
(issue 31 target 4: W2's prompts x samples, forced new tokens, temperature 1, the same seeds) run in this process on
one thread under torch.profiler, its time split into matmul, attention and the rest, each set against
the work it did and this thread's ceiling for it.

    PYTHONPATH=benchmarks python -m lichen_bench.decode_profile [--model w2] [--prompts 8] [--samples 8]
        [--tokens 256] [--work-dir runs/bench_decode_profile]

Times are the profiler's (wall time inside each operator; the process runs one thread), shares of the unprofiled
pass's wall time (the profiler's own cost, a third of a profiled pass here, stays out):
- matmul: the self time of aten::mm / addmm / bmm and the FLOPs torch.profiler counts for them, against the fp32
  matmul ceiling of this thread (`lichen_bench.limits.matmul_throughput`: a 2048^3 product, best of 20);
- attention: the self time of the scaled-dot-product operators and the key/value bytes they read, counted from
  every decode forward (rows x key slots x layers x 2 x kv heads x head dim x element size: the cache view each
  forward attends over, masked slots included, as the kernel reads them), against this thread's memory read
  speed (a sum over 256 MB, as `lichen_bench.decode_gemm` measures it);
- other: the rest of the unprofiled pass: the other operators (norms, rotary, sampling) and the Python around
  them.
Last, one decode step's attention at the pass's mean shape, each layer its own cache, two ways: torch's
scaled_dot_product_attention (the engine's kernel) and two plain matmuls around a softmax; if both read the keys
and values at about the memory read speed, no other kernel would make attention much faster on this machine.

The unprofiled pass also gives tokens per CPU second, the number `lichen bench engines` reports per server.
docs/performance.md#where-a-decode-step-goes has a run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from lichen_bench.decode_gemm import median_s, read_speed

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm")


def record_forwards(model: Any) -> tuple[list[tuple[int, int]], list[tuple[int, int]], Any]:
    """Patch `model.forward` to record every cached forward: (rows, key slots attended) of each decode forward
    (one new token per row) and (rows, new tokens) of each prefill. Returns the two lists and an undo function."""
    decode: list[tuple[int, int]] = []
    prefill: list[tuple[int, int]] = []
    original = type(model).forward

    def recording(self: Any, input_ids: Any, position_ids: Any, cache: Any = None, attn_mask: Any = None) -> Any:
        if cache is not None:
            rows, new = input_ids.shape
            if new == 1:
                decode.append((rows, cache.length + 1))
            else:
                prefill.append((rows, new))
        return original(self, input_ids, position_ids, cache=cache, attn_mask=attn_mask)

    model.forward = recording.__get__(model)

    def undo() -> None:
        del model.forward

    return decode, prefill, undo


def kv_bytes(cfg: Any, decode: list[tuple[int, int]], element_size: int) -> int:
    """Key and value bytes the decode forwards' attention reads: sum over forwards of rows x slots, times layers x
    2 (keys, values) x kv heads x head dim x element size."""
    slots = sum(rows * keys for rows, keys in decode)
    return slots * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * element_size


def split_profile(events: Any) -> dict[str, dict[str, float]]:
    """torch.profiler key averages -> {"matmul", "attention", "other": {"s": self seconds, "flops": ...}}
    ("other": every other operator's self time)."""
    out = {k: {"s": 0.0, "flops": 0.0} for k in ("matmul", "attention", "other")}
    for e in events:
        if e.key in MATMUL_OPS:
            part = "matmul"
        elif "scaled_dot_product" in e.key:
            part = "attention"
        else:
            part = "other"
        out[part]["s"] += e.self_cpu_time_total / 1e6
        out[part]["flops"] += float(getattr(e, "flops", 0) or 0)
    return out


def explicit_attention(q: Any, k: Any, v: Any) -> Any:
    """softmax(q k^T / sqrt(d)) v for one new query per row: q [rows, heads, 1, d], k and v [rows, kv heads, slots,
    d], query head h reading kv head h // (heads / kv heads); keys are read once per kv head, as a kernel would."""
    import torch

    rows, heads, _, d = q.shape
    kv_heads = k.shape[1]
    qg = q.reshape(rows, kv_heads, heads // kv_heads, d)
    out = torch.matmul(torch.softmax(torch.matmul(qg, k.transpose(-1, -2)) * d**-0.5, -1), v)
    return out.reshape(rows, heads, 1, d)


def attention_kernels(cfg: Any, rows: int, slots: int, repeats: int = 5) -> dict[str, float]:
    """Seconds (median of `repeats`) of one decode step's attention over every layer, each layer its own cache of
    `rows` x `slots` keys and values (so nothing stays in cache between layers, as in the engine): torch's
    scaled_dot_product_attention (the engine's) and the explicit softmax(q k^T / sqrt(d)) v of two matmuls."""
    import torch
    import torch.nn.functional as F

    kv = (rows, cfg.num_kv_heads, slots, cfg.head_dim)
    caches = [(torch.randn(kv), torch.randn(kv)) for _ in range(cfg.num_layers)]
    q = torch.randn(rows, cfg.num_heads, 1, cfg.head_dim)
    group = cfg.num_heads // cfg.num_kv_heads

    def sdpa() -> None:
        for k, v in caches:
            F.scaled_dot_product_attention(q, k, v, enable_gqa=group > 1)

    def explicit() -> None:
        for k, v in caches:
            explicit_attention(q, k, v)

    return {"sdpa": median_s(sdpa, repeats), "explicit": median_s(explicit, repeats)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lichen_bench.decode_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="w2", help="w2 or a parameter count, as `lichen bench engines` (default w2)")
    p.add_argument("--prompts", type=int, default=8, help="W2's prompts (default 8)")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt (default 8)")
    p.add_argument("--tokens", type=int, default=256, help="forced new tokens per sample (default 256)")
    p.add_argument("--matmul-size", type=int, default=2048, help="side of the ceiling's matmul (default 2048)")
    p.add_argument("--work-dir", default="runs/bench_decode_profile", help="model and prompts go here")
    p.add_argument("--json", help="also write the numbers here")
    a = p.parse_args(argv)
    if min(a.prompts, a.samples, a.tokens, a.matmul_size) < 1:
        p.error("--prompts, --samples, --tokens and --matmul-size must be at least 1")
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoTokenizer

    from lichen.engines.core.engine import Engine
    from lichen_bench.engines import make_model, write_prompts
    from lichen_bench.engines_gen import _requests
    from lichen_bench.limits import matmul_throughput

    torch.set_num_threads(1)
    os.makedirs(a.work_dir, exist_ok=True)
    model = make_model(a.work_dir, a.model)
    with open(write_prompts(a.work_dir, a.prompts), encoding="utf-8") as f:
        texts = [json.loads(line)["prompt"] for line in f][: a.prompts]
    tok = AutoTokenizer.from_pretrained(model["dir"])
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    engine = Engine.from_pretrained(model["dir"], device="cpu")
    requests = _requests(ids, a.samples, a.tokens)
    useful = len(requests) * a.tokens

    engine.generate(_requests(ids[:2], 1, 8))  # warm-up, not timed
    c0, t0 = time.process_time(), time.perf_counter()
    engine.generate(requests)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    read = read_speed()
    peak = matmul_throughput(a.matmul_size, threads=1)["best_flops_per_s"]

    decode, prefill, undo = record_forwards(engine.model)
    try:
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
            engine.generate(requests)
        profiled = time.perf_counter() - t0
    finally:
        undo()
    parts = split_profile(prof.key_averages())
    total = wall
    parts["other"]["s"] = max(0.0, total - parts["matmul"]["s"] - parts["attention"]["s"])
    element = next(engine.model.parameters()).element_size()
    kv = kv_bytes(engine.model.cfg, decode, element)
    print(
        f"{model['name']} ({model['params'] / 1e6:.1f}M parameters), {a.prompts} prompts x {a.samples} samples x "
        f"{a.tokens} forced tokens ({useful} tokens), one thread"
    )
    print(f"unprofiled pass: {wall:.2f} s ({cpu:.2f} CPU-s), {useful / cpu:.1f} tokens per CPU-s")
    print(
        f"this thread's ceilings: memory read {read / 1e9:.1f} GB/s (sum of 256 MB), fp32 matmul "
        f"{peak / 1e9:.1f} GFLOP/s ({a.matmul_size}^3, best of 20)"
    )
    rows = sum(r for r, _ in decode) / max(1, len(decode))
    slots = sum(k for _, k in decode) / max(1, len(decode))
    print(
        f"profiled pass: {len(decode)} decode forwards (mean {rows:.1f} rows x {slots:.1f} key slots), "
        f"{len(prefill)} prefill(s); {profiled:.2f} s"
    )
    print(f"{'part':<10} {'s':>7} {'share':>6}  {'work':<36} rate")
    mm, at = parts["matmul"], parts["attention"]
    mm_rate = mm["flops"] / mm["s"] if mm["s"] else 0.0
    at_rate = kv / at["s"] if at["s"] else 0.0
    print(
        f"{'matmul':<10} {mm['s']:7.2f} {mm['s'] / total:6.1%}  {mm['flops'] / 1e9:8.1f} GFLOP{'':<23} "
        f"{mm_rate / 1e9:.1f} GFLOP/s, {mm_rate / peak:.2f} of the matmul ceiling"
    )
    print(
        f"{'attention':<10} {at['s']:7.2f} {at['s'] / total:6.1%}  {kv / 1e9:8.2f} GB of keys and values read{'':<6} "
        f"{at_rate / 1e9:.1f} GB/s, {at_rate / read:.2f} of the memory read ceiling"
    )
    print(f"{'other':<10} {parts['other']['s']:7.2f} {parts['other']['s'] / total:6.1%}")
    step_rows, step_slots = round(rows), round(slots)
    kernels = attention_kernels(engine.model.cfg, step_rows, step_slots) if decode else {}
    step_bytes = kv_bytes(engine.model.cfg, [(step_rows, step_slots)], element)
    for name, sec in kernels.items():
        print(
            f"attention of one decode step at the mean shape ({step_rows} rows x {step_slots} slots, "
            f"{step_bytes / 1e6:.1f} MB), {name:<8}: {sec * 1e3:6.2f} ms, {step_bytes / sec / 1e9:.1f} GB/s"
        )
    if a.json:
        out = {
            "model": model,
            "requests": {"prompts": a.prompts, "samples": a.samples, "tokens": a.tokens},
            "unprofiled_cpu_s": cpu,
            "unprofiled_s": wall,
            "profiled_s": profiled,
            "read_bytes_per_s": read,
            "matmul_flops_per_s": peak,
            "decode_forwards": decode,
            "prefills": prefill,
            "kv_bytes": kv,
            "parts": parts,
            "attention_kernels_s": kernels,
        }
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
