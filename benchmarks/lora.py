"""LoRA against full fine-tuning on a ~20M-parameter llama: optimizer state and trainer step time (docs/lora.md).

    .venv/bin/python benchmarks/lora.py [--steps 6] [--warmup 1] [--rank 8] [--workdir runs/lora_bench]
    .venv/bin/python benchmarks/lora.py quickstart [--seeds 1 2 3] [--rank 16] [--lr 1e-3] [--report]

One process builds a random llama with `lichen make-tiny-model` (hidden 512, 6 layers, intermediate 1376: about
20M parameters), then two TrainActors on it, full fine-tuning and `--use-lora` (rank --rank, alpha 2 x rank,
preset dense_language = attention + MLP projections), and trains both on the same synthetic batches, alternating
one step each so that machine load hits both alike. Printed: trainable parameters, AdamW state bytes (exp_avg and
exp_avg_sq of every parameter the optimizer holds), the median `train` step time after --warmup steps, and the
ratios LoRA / full. A measurement, not a test: on shared cores the step times move with the machine's load.

`quickstart`: for each seed, examples/quickstart.py from nothing (tiny model, SFT warm-up, GRPO with full
fine-tuning), then the same GRPO stage again from the same SFT checkpoint with `--use-lora` (--rank, alpha 2 x rank,
--lr as `--lora-learning-rate`); prints the held-out accuracy after SFT, after full RL and after LoRA RL, the
gains in points, their means with 95% confidence intervals (Student t over the seeds) and that of the paired
difference LoRA - full. `--report` runs nothing: it reads the given seeds' results from --workdir (seeds split
across several invocations are summarised together). Reported, not gated.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--samples", type=int, default=16, help="samples per train step (4 per group)")
    p.add_argument("--seq-len", type=int, default=96, help="prompt + response tokens of each sample")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: a fair share of a shared box)")
    p.add_argument("--workdir", default="runs/lora_bench")
    return p.parse_args(argv)


def make_model(workdir: str) -> str:
    from lichen.models.tiny import make_tiny_model

    path = os.path.join(workdir, "llama20m")
    if not os.path.isfile(os.path.join(path, "config.json")):
        make_tiny_model(
            path,
            arch="llama",
            hidden_size=512,
            num_layers=6,
            num_heads=8,
            num_kv_heads=8,
            intermediate_size=1376,
            seed=0,
        )
    return path


def make_trainer(model: str, workdir: str, extra: list[str]):
    from lichen.config import TrainerConfig, parse_train_args
    from lichen.train.actor import TrainActor

    data = os.path.join(workdir, "prompts.jsonl")
    with open(data, "w") as f:
        f.write(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    args = parse_train_args(
        [
            "--hf-checkpoint",
            model,
            "--prompt-data",
            data,
            "--rm-type",
            "math",
            "--rollout-batch-size",
            "4",
            "--n-samples-per-prompt",
            "4",
            "--num-rollout",
            "1",
            "--micro-batch-size",
            "4",
            "--lr",
            "1e-4",
            "--output-dir",
            os.path.join(workdir, "out"),
            "--no-progress",
            *extra,
        ]
    )
    return TrainActor(TrainerConfig.from_args(args), plugin_args=args)


def batch(vocab: int, a: argparse.Namespace, seed: int):
    from lichen.types import Sample, Status

    rng = random.Random(seed)
    samples = []
    for i in range(a.samples):
        resp = a.seq_len // 2
        samples.append(
            Sample(
                tokens=[rng.randrange(3, vocab) for _ in range(a.seq_len)],
                response_length=resp,
                reward=float(rng.random() < 0.5),
                status=Status.COMPLETED,
                group_index=i // 4,
                index=i,
                rollout_log_probs=[-2.0] * resp,
            )
        )
    return [samples[i : i + 4] for i in range(0, len(samples), 4)]


def optimizer_state_bytes(optimizer) -> int:
    return sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if hasattr(t, "numel") and t.dim() > 0
    )


def quickstart(argv: list[str]) -> int:
    import importlib.util
    import subprocess
    import sys

    p = argparse.ArgumentParser(prog="benchmarks/lora.py quickstart")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3, help="--lora-learning-rate of the LoRA GRPO stage")
    p.add_argument("--workdir", default="runs/lora_quickstart")
    p.add_argument("--report", action="store_true", help="run nothing; summarise the seeds' results in --workdir")
    a = p.parse_args(argv)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "quickstart.py")
    spec = importlib.util.spec_from_file_location("quickstart", path)
    qs = importlib.util.module_from_spec(spec)
    sys.modules["quickstart"] = qs  # its dataclasses look their module up
    spec.loader.exec_module(qs)
    rows = []
    for seed in a.seeds:
        root = os.path.abspath(os.path.join(a.workdir, f"seed{seed}"))
        out = os.path.join(root, "rl_lora")
        if a.report:
            rows.append(_seed_row(seed, root, qs))
            continue
        subprocess.run([sys.executable, path, "--seed", str(seed), "--workdir", root, "--quiet"], check=True)
        with open(os.path.join(root, "summary.json")) as f:
            json.load(f)  # the run wrote a readable summary
        args = qs.parse_args(["--seed", str(seed), "--workdir", root])
        paths = qs.Paths(root)
        argv_rl = qs.rl_argv(args, paths, qs.sft_checkpoint(paths))
        argv_rl[argv_rl.index("--output-dir") + 1] = out
        argv_rl += [
            "--use-lora",
            "--lora-rank",
            str(a.rank),
            "--lora-alpha",
            str(2 * a.rank),
            "--lora-learning-rate",
            str(a.lr),
        ]
        if os.path.isdir(out):
            import shutil

            shutil.rmtree(out)
        wall, _ = qs.run_stage("rl_lora", argv_rl, os.path.join(root, "rl_lora.log"), True, args.threads)
        with open(os.path.join(out, "wall_seconds.txt"), "w") as f:
            f.write(f"{wall}\n")
        rows.append(_seed_row(seed, root, qs))
        print(
            f"seed {seed}: SFT {100 * rows[-1][1]:.1f}%, full RL {100 * rows[-1][2]:.1f}%, "
            f"LoRA RL {100 * rows[-1][3]:.1f}%",
            flush=True,
        )
    print(f"\nLoRA rank {a.rank}, alpha {2 * a.rank}, lr {a.lr:g} (full fine-tuning: the quick start's own RL stage)")
    print("seed  after SFT  full RL (gain)    LoRA RL (gain)    RL wall s full / LoRA")
    for seed, sft, full_acc, lora_acc, t_full, t_lora in rows:
        print(
            f"{seed:>4}  {100 * sft:8.1f}%  {100 * full_acc:5.1f}% ({100 * (full_acc - sft):+5.1f})  "
            f"{100 * lora_acc:5.1f}% ({100 * (lora_acc - sft):+5.1f})   {t_full:.0f} / {t_lora:.0f}"
        )
    gains = [(100 * (f - s), 100 * (lo - s)) for _, s, f, lo, _, _ in rows]
    print(
        f"mean gain: full {statistics.mean(g[0] for g in gains):+.1f} points, "
        f"LoRA {statistics.mean(g[1] for g in gains):+.1f} points over {len(rows)} seeds"
    )
    if len(rows) >= 2:
        from lichen_bench.learning import paired_ci

        for name, xs in (
            ("full", [g[0] for g in gains]),
            ("LoRA", [g[1] for g in gains]),
            ("LoRA - full", [g[1] - g[0] for g in gains]),
        ):
            ci = paired_ci(xs)
            print(f"{name}: mean {ci['mean']:+.2f} points, 95% CI [{ci['lower']:+.2f}, {ci['upper']:+.2f}]")
    return 0


def _seed_row(seed: int, root: str, qs) -> tuple:
    """(seed, SFT accuracy, full RL accuracy, LoRA RL accuracy, full RL wall s, LoRA RL wall s) from `root`."""
    with open(os.path.join(root, "summary.json")) as f:
        full = json.load(f)
    out = os.path.join(root, "rl_lora")
    curve = qs.eval_curve(os.path.join(out, "metrics.jsonl"))
    wall_file = os.path.join(out, "wall_seconds.txt")
    wall = float("nan")
    if os.path.isfile(wall_file):
        with open(wall_file) as f:
            wall = float(f.read())
    return seed, full["sft_accuracy"], full["rl_accuracy"], curve[-1][1], full["seconds"]["rl"], wall


def main(argv: list[str] | None = None) -> int:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["quickstart"]:
        return quickstart(argv[1:])
    a = parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    os.makedirs(a.workdir, exist_ok=True)
    model = make_model(a.workdir)
    runs = {
        "full": make_trainer(model, a.workdir, []),
        "lora": make_trainer(
            model, a.workdir, ["--use-lora", "--lora-rank", str(a.rank), "--lora-alpha", str(2 * a.rank)]
        ),
    }
    n_params = sum(p.numel() for p in runs["full"].model.parameters())
    times: dict[str, list[float]] = {k: [] for k in runs}
    for step in range(a.warmup + a.steps):
        groups = batch(runs["full"].model.cfg.vocab_size, a, seed=step)
        for name, trainer in runs.items():
            t0 = time.perf_counter()
            trainer.train(step, groups)
            if step >= a.warmup:
                times[name].append(time.perf_counter() - t0)
    print(
        f"llama, {n_params / 1e6:.1f}M parameters; {a.samples} samples x {a.seq_len} tokens per step, "
        f"{a.steps} measured steps, {a.threads} torch thread(s), LoRA rank {a.rank} alpha {2 * a.rank} "
        "(dense_language: attention + MLP)"
    )
    row = "{:<6} {:>16} {:>22} {:>16}"
    print(row.format("", "trainable params", "optimizer state (MiB)", "step time (s)"))
    stats = {}
    for name, trainer in runs.items():
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        stats[name] = (trainable, optimizer_state_bytes(trainer.optimizer), statistics.median(times[name]))
        print(row.format(name, f"{stats[name][0]:,}", f"{stats[name][1] / 2**20:.2f}", f"{stats[name][2]:.3f}"))
    (tl, sl, ml), (tf, sf, mf) = stats["lora"], stats["full"]
    print(f"LoRA / full: trainable params {tl / tf:.4f}, optimizer state {sl / sf:.4f}, step time {ml / mf:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
