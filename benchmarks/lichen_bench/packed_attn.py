"""`lichen bench packed`: a train step over packed rows, attention per segment vs one call with the dense mask.

The trainer packs samples side by side in rows of up to `--max-tokens` positions (CPU; a group's prompt once,
docs/algorithms.md#prompt-sharing) and computes their attention segment by segment
(lichen.models.packed_attention). The baseline is what it did before: one SDPA call over the row with the dense
[rows, 1, T, T] block mask (`PackedLayout.dense_mask`). Both variants, in this process, on the same weights and
micro-batches:

- the step: forward over every micro-batch (the model's hidden states at the response positions, a mean of their
  squares as the loss) and its backward; median of `--repeats` steps after one warm-up step per variant, the two
  variants alternating step by step so machine load falls on both;
- agreement: the largest |per segment - dense| of those hidden states and of the gradients (relative to the
  largest dense gradient).

The samples are W2-like: `--prompts` prompts of `--prompt-len` random tokens, `--samples` answers each, of lengths
drawn from an exponential with mean `--answer-mean` (at least 1, at most 256). The model defaults to W2's shape
(lichen_bench.compile_layers.build: hidden 512, 6 layers, 8 heads, MLP 1536, 102-token vocabulary, random init).
`--device cuda` runs it on a GPU (scripts/gpu_check.sh does, in bf16): the data for deciding whether GPUs should
pack rows too, which they do not today.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from lichen_bench.compile_layers import add_model_args, add_run_args

    p = argparse.ArgumentParser(
        prog="lichen bench packed", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--prompts", type=int, default=8, help="distinct prompts (default 8)")
    p.add_argument("--samples", type=int, default=8, help="answers per prompt (default 8)")
    p.add_argument("--prompt-len", type=int, default=12, help="tokens per prompt (default 12, W2's)")
    p.add_argument("--answer-mean", type=float, default=55.0, help="mean answer length (default 55, W2's)")
    p.add_argument("--max-tokens", type=int, default=512, help="positions per micro-batch (default 512)")
    p.add_argument("--no-sharing", action="store_true", help="every sample lays out its own prompt")
    add_model_args(p)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="model dtype (default float32)")
    add_run_args(p, threads=1)
    args = p.parse_args(argv)
    for name in ("prompts", "samples", "prompt_len", "max_tokens", "hidden", "layers", "heads", "mlp", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.vocab < 4 or args.threads < 1 or args.answer_mean <= 0:
        p.error("--vocab must be at least 4, --threads at least 1, --answer-mean positive")
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    args.seq = args.max_tokens  # what compile_layers.build sizes the rotary table for
    return args


def micro_batches(args: argparse.Namespace, device: torch.device) -> list[Any]:
    from lichen.train.micro_batches import StepBatch, plan_micro_batches
    from lichen.types import Sample

    rng = random.Random(args.seed)
    samples = []
    for g in range(args.prompts):
        prompt = [rng.randrange(3, args.vocab) for _ in range(args.prompt_len)]
        for j in range(args.samples):
            n = min(256, max(1, int(rng.expovariate(1 / args.answer_mean))))
            answer = [rng.randrange(3, args.vocab) for _ in range(n)]
            samples.append(Sample(index=g * args.samples + j, tokens=prompt + answer, response_length=n))
    batch = StepBatch(samples, pad_id=0, share_prompts=not args.no_sharing)
    plans = plan_micro_batches(
        list(range(len(samples))),
        batch.input_lengths,
        micro_batch_size=1,
        max_tokens=args.max_tokens,
        sharing=batch.sharing,
    )
    return [batch.micro(plan, device) for plan in plans]


def step(model: torch.nn.Module, mbs: list[Any], dense: bool) -> tuple[float, list, list]:
    """(seconds, response hidden states per micro-batch, gradients) of one forward + backward."""
    model.zero_grad(set_to_none=True)
    sync = torch.cuda.synchronize if mbs[0].input_ids.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    hidden = []
    for mb in mbs:
        mask = mb.attn_mask.dense_mask(mb.input_ids.device) if dense and mb.attn_mask is not None else mb.attn_mask
        h = mb.response_hidden(model(mb.input_ids, mb.position_ids, attn_mask=mask))
        h.float().pow(2).mean().backward()
        hidden.append(h.detach())
    sync()
    seconds = time.perf_counter() - t0
    return seconds, hidden, [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def main(argv: list[str] | None = None) -> int:
    from lichen_bench.compile_layers import build

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = build(args).to(device=device, dtype=getattr(torch, args.dtype))
    mbs = micro_batches(args, device)
    _, h_dense, g_dense = step(model, mbs, dense=True)  # warm-up, and the reference
    _, h_seg, g_seg = step(model, mbs, dense=False)
    times: dict[str, list[float]] = {"dense": [], "segments": []}
    for _ in range(args.repeats):
        for name in times:
            times[name].append(step(model, mbs, dense=name == "dense")[0])
    scale = max(float(g.abs().max()) for g in g_dense) or 1.0
    positions = sum(mb.num_tokens for mb in mbs)
    res = {
        "settings": vars(args),
        "micro_batches": len(mbs),
        "positions": positions,
        "dense_s": statistics.median(times["dense"]),
        "segments_s": statistics.median(times["segments"]),
        "times": times,
        "max_hidden_diff": max(float((a.float() - b.float()).abs().max()) for a, b in zip(h_seg, h_dense)),
        "max_grad_diff_rel": max(float((a - b).abs().max()) for a, b in zip(g_seg, g_dense)) / scale,
    }
    print(
        f"{args.prompts} prompts x {args.samples} answers (mean {args.answer_mean:g} tokens), {len(mbs)} micro-batches "
        f"of <= {args.max_tokens} positions ({positions} in all), {args.device} {args.dtype}, {args.threads} thread(s)"
    )
    print(f"  {'variant':<26} {'step s (median)':>16}")
    print(f"  {'dense mask (one call)':<26} {res['dense_s']:>16.3f}")
    print(f"  {'per segment':<26} {res['segments_s']:>16.3f}")
    print(f"per segment / dense step time: {res['segments_s'] / res['dense_s']:.3f}x")
    print(f"max |per segment - dense|: hidden {res['max_hidden_diff']:.2e}, gradients {res['max_grad_diff_rel']:.2e} "
          "of the largest")  # fmt: skip
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2)
    return 0
