"""The generic HF path (--model-impl hf) against lichen's own model code, same run, same checkpoint (docs/models.md).

    .venv/bin/python benchmarks/model_impl.py [--repeats 3] [--threads 1] [--workdir runs/model_impl_bench]

A ~20M-parameter llama (make-tiny-model, hidden 448, 8 layers) is loaded through both implementations. Measured,
alternating the two implementations each repeat and keeping the median:
- engine: useful tokens per second of `Engine.generate` (the in-process engine lichen's loop uses) over
  --requests prompts of --prompt-len tokens, --new-tokens each (ignore_eos, so every token is useful), batch cap
  --batch;
- trainer: one training step as the trainer takes it: forward over a [--train-batch, --train-len] batch, lichen's
  log-prob convention (log_softmax of fp32 logits), a policy-gradient-shaped loss, backward, AdamW step.
Ratios are hf / lichen (tok/s: below 1 means the HF path is slower; step time: above 1 means slower). A measurement,
not a test: on shared cores the numbers move with the machine's load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="runs/model_impl_bench")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--batch", type=int, default=16, help="engine max batch size")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--train-batch", type=int, default=8)
    p.add_argument("--train-len", type=int, default=128)
    return p.parse_args(argv)


def engine_tok_s(model, args) -> float:
    from lichen.engines.core.engine import Engine, GenRequest

    engine = Engine(model, eos_token_ids=[1], max_batch_size=args.batch)
    reqs = [
        GenRequest(
            input_ids=[5 + (i * 7 + j) % 90 for j in range(args.prompt_len - i % 4)],
            max_new_tokens=args.new_tokens,
            temperature=1.0,
            seed=i,
            ignore_eos=True,
        )
        for i in range(args.requests)
    ]
    t0 = time.perf_counter()
    out = engine.generate(reqs)
    return sum(len(r.output_ids) for r in out) / (time.perf_counter() - t0)


def train_step_s(model, args) -> float:
    import torch

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 100, (args.train_batch, args.train_len), generator=gen)
    pos = torch.arange(args.train_len)[None].expand(args.train_batch, -1)
    adv = torch.randn(args.train_batch, args.train_len - 1, generator=gen)
    t0 = time.perf_counter()
    logits = model.logits(model(ids, pos)).float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss = -(adv * logp).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from lichen.models.loading import load_model
    from lichen.models.tiny import make_tiny_model

    torch.set_num_threads(args.threads)
    ckpt = os.path.join(args.workdir, "llama20m")
    make_tiny_model(
        ckpt,
        arch="llama",
        hidden_size=448,
        num_layers=8,
        num_heads=7,
        intermediate_size=1216,
        max_position_embeddings=512,
        seed=0,
    )
    models = {impl: load_model(ckpt, impl=impl) for impl in ("lichen", "hf")}
    n_params = sum(p.numel() for p in models["lichen"].parameters())
    tok_s = {impl: [] for impl in models}
    step_s = {impl: [] for impl in models}
    train_step_s(models["lichen"], args), train_step_s(models["hf"], args)  # warm-up (allocator, kernels)
    for _ in range(args.repeats):
        for impl, model in models.items():
            with torch.no_grad():
                tok_s[impl].append(engine_tok_s(model.eval(), args))
            step_s[impl].append(train_step_s(model, args))
    med = {k: {impl: statistics.median(v) for impl, v in d.items()} for k, d in (("tok_s", tok_s), ("step_s", step_s))}
    print(f"llama {n_params / 1e6:.1f}M parameters, {args.threads} thread(s), median of {args.repeats}")
    print(f"{'':28}{'lichen':>10}{'hf':>10}{'hf / lichen':>14}")
    print(
        f"{'engine useful tok/s':28}{med['tok_s']['lichen']:>10.1f}{med['tok_s']['hf']:>10.1f}"
        f"{med['tok_s']['hf'] / med['tok_s']['lichen']:>14.2f}"
    )
    print(
        f"{'trainer step time (s)':28}{med['step_s']['lichen']:>10.3f}{med['step_s']['hf']:>10.3f}"
        f"{med['step_s']['hf'] / med['step_s']['lichen']:>14.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
