"""`lichen bench compile`: the trainer's forward and backward with each decoder layer compiled, vs eager.

A lever of the performance issue (round 3, target 2): regional compilation, `torch.compile` applied to each
`DecoderLayer` of lichen's transformer (lichen.models.transformer), which lets inductor fuse the memory-bound
elementwise work around the matmuls (RMSNorm, RoPE, SwiGLU, the residual adds). Measured here on one model,
both variants in this process, on the same weights and batch:

- a step: the forward over `--batch` rows of `--seq` tokens, the log-probs of the next tokens (fp32
  log-softmax over the vocabulary), the mean of them as the loss, its backward; median of `--repeats` steps
  after one warm-up step per variant, the two variants alternating step by step so machine load falls on both;
- compile: the seconds of the compiled variant's first step (tracing and code generation; amortized over a run,
  reported apart, never in the step time);
- agreement: the largest |compiled - eager| of the log-probs and of the gradients (relative to the largest
  eager gradient), fp32.

The model defaults to W2's (lichen_bench.workloads: hidden 512, 6 layers, 8 heads, MLP 1536, lichen's tiny
character vocabulary of 102 tokens, 20.5M parameters, random init); the batch is 16 rows of 256 tokens. Prints one table and compiled / eager; exit status 0 unless a variant failed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model's shape (`build`), W2's by default."""
    p.add_argument("--hidden", type=int, default=512, help="hidden size (default 512, W2's)")
    p.add_argument("--layers", type=int, default=6, help="decoder layers (default 6)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    p.add_argument("--mlp", type=int, default=1536, help="MLP intermediate size (default 1536)")
    p.add_argument("--vocab", type=int, default=102, help="vocabulary size (default 102, W2's character vocabulary)")


def add_run_args(p: argparse.ArgumentParser, threads: int) -> None:
    """How a microbenchmark runs: repeats, torch threads (default `threads`), seed, JSON output."""
    p.add_argument("--repeats", type=int, default=5, help="timed steps per variant (default 5)")
    p.add_argument("--threads", type=int, default=threads, help=f"torch threads (default {threads})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the measurements as JSON here")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="lichen bench compile", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(p)
    p.add_argument("--batch", type=int, default=16, help="rows of the step (default 16)")
    p.add_argument("--seq", type=int, default=256, help="tokens per row (default 256)")
    add_run_args(p, threads=2)
    args = p.parse_args(argv)
    for name in ("hidden", "layers", "heads", "mlp", "vocab", "batch", "seq", "repeats", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    return args


def build(args: argparse.Namespace) -> torch.nn.Module:
    from lichen.models.config import ModelConfig
    from lichen.models.transformer import CausalLM

    cfg = ModelConfig(
        model_type="llama", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.mlp,
        num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.heads, head_dim=args.hidden // args.heads,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=max(2048, args.seq),
        tie_word_embeddings=True, attention_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
        rope_scaling=None,
    )  # fmt: skip
    torch.manual_seed(args.seed)
    model = CausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    return model


def step(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor) -> tuple[float, torch.Tensor, list]:
    """(seconds, next-token log-probs, gradients) of one forward + backward."""
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    hidden = model(ids[:, :-1], pos[:, :-1])
    logits = model.logits(hidden).float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    logp.mean().backward()
    seconds = time.perf_counter() - t0
    return seconds, logp.detach(), [p.grad.detach().clone() for p in model.parameters()]


def compile_layers(model: Any) -> None:
    """Each decoder layer compiled on its own (regional compilation: one graph per layer, reused by all)."""
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = torch.compile(layer, dynamic=False)


def main(argv: list[str] | None = None) -> int:
    import copy

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    eager = build(args)
    compiled = copy.deepcopy(eager)
    compile_layers(compiled)
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    pos = torch.arange(args.seq + 1)[None].expand(args.batch, -1)
    _, logp_e, grads_e = step(eager, ids, pos)  # warm-up
    compile_s, logp_c, grads_c = step(compiled, ids, pos)  # tracing + code generation + the step
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(args.repeats):
        for name, m in (("eager", eager), ("compiled", compiled)):
            times[name].append(step(m, ids, pos)[0])
    scale = max(float(gr.abs().max()) for gr in grads_e) or 1.0
    res = {
        "settings": vars(args),
        "params": sum(p.numel() for p in eager.parameters()),
        "eager_s": statistics.median(times["eager"]),
        "compiled_s": statistics.median(times["compiled"]),
        "times": times,
        "first_compiled_step_s": compile_s,
        "max_logprob_diff": float((logp_c - logp_e).abs().max()),
        "max_grad_diff_rel": max(float((a - b).abs().max()) for a, b in zip(grads_c, grads_e)) / scale,
    }
    tokens = args.batch * args.seq
    print(f"model {res['params'] / 1e6:.1f}M parameters, {args.batch} x {args.seq} tokens, {args.threads} thread(s)")
    print(f"  {'variant':<9} {'step s (median)':>16} {'tokens/s':>10}")
    for name in ("eager", "compiled"):
        s = res[f"{name}_s"]
        print(f"  {name:<9} {s:>16.3f} {tokens / s:>10.0f}")
    print(f"compiled / eager step time: {res['compiled_s'] / res['eager_s']:.3f}x")
    print(f"first compiled step (compile included): {compile_s:.1f} s")
    print(f"max |compiled - eager|: log-probs {res['max_logprob_diff']:.2e}, gradients {res['max_grad_diff_rel']:.2e} "
          "of the largest")  # fmt: skip
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2)
    return 0
