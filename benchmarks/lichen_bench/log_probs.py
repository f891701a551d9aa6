"""`lichen bench logprobs`: the trainer's log-prob phase at a real vocabulary, chunked vs full logits.

A model with Qwen3's 151,936-token vocabulary and a small body (llama layout, hidden 256, 2 layers, tied
embeddings: the LM head is nearly all the work) runs `TrainActor.train` on one group of samples holding
`--tokens` response tokens in one micro-batch (GRPO, distinct rewards so every sample trains, no zero-advantage
skip), once with
`--log-probs-chunk-size -1` (the full [tokens, vocabulary] logits, as before issue 31) and once with the chunked
computation (lichen.train.chunked_logprobs). Each variant runs in a fresh child process: one warm-up step (Adam's
state is allocated there), then `--repeats` timed steps. Per step:

- time: wall-clock of `TrainActor.train`;
- peak memory: the process's peak resident set (VmHWM) during the step minus its resident set before it. VmHWM is
  reset before each step by writing 5 to /proc/self/clear_refs (Linux), so each step's peak is its own; torch's
  CPU allocator keeps no statistics, and its large blocks come from mmap and go back at free, so the resident set
  follows the live tensors.

It prints the medians and the ratios chunked / full. Children alternate which variant runs first over
`--rounds` (default 1) to spread machine load over both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VOCAB = 151_936


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="lichen bench logprobs", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--vocab", type=int, default=VOCAB, help=f"vocabulary size (default {VOCAB}, Qwen3's)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--tokens", type=int, default=4096, help="response tokens of the train step (default 4096)")
    p.add_argument("--samples", type=int, default=8, help="samples the response tokens are split over (default 8)")
    p.add_argument("--chunk-size", type=int, default=512, help="--log-probs-chunk-size of the chunked run (512)")
    p.add_argument("--temperature", type=float, default=0.7, help="--rollout-temperature (default 0.7)")
    p.add_argument("--entropy-coef", type=float, default=0.0, help="--entropy-coef (default 0: no entropy term)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per variant (default 5)")
    p.add_argument("--rounds", type=int, default=1, help="child processes per variant, alternating (default 1)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--work-dir", default=None, help="where the checkpoint is written (default: a temporary dir)")
    p.add_argument("--json", default=None, help="write every measurement as JSON here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: run one variant, print JSON
    return p.parse_args(argv)


def make_checkpoint(out_dir: str, args: argparse.Namespace) -> str:
    """lichen's tiny llama at `--hidden`/`--layers`, its vocabulary widened to `--vocab` (the character tokenizer
    stays; the benchmark's token ids are drawn directly)."""
    from safetensors.torch import save_file

    from lichen.models import tiny

    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        with open(os.path.join(out_dir, "config.json"), encoding="utf-8") as f:
            if json.load(f)["vocab_size"] == args.vocab:
                return out_dir
    heads = max(1, args.hidden // 64)
    tiny.make_tiny_model(
        out_dir, hidden_size=args.hidden, num_layers=args.layers, num_heads=heads, intermediate_size=4 * args.hidden
    )
    with open(os.path.join(out_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["vocab_size"] = args.vocab
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    save_file(tiny._init_weights(cfg, 0, float(cfg["initializer_range"])), os.path.join(out_dir, "model.safetensors"))
    return out_dir


def _status_kb(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # resets VmHWM to the current resident set (Linux >= 4.0)


def run_child(args: argparse.Namespace, ckpt: str, chunk: int) -> dict:
    """One variant in this process: a warm-up step, then `--repeats` timed steps."""
    import random

    import torch

    from lichen.config import TrainerConfig, parse_train_args
    from lichen.train.actor import TrainActor
    from lichen.types import Sample, Status

    torch.set_num_threads(args.threads)
    flags = ["--hf-checkpoint", ckpt, "--num-rollout", "1", "--rollout-batch-size", "1"]
    flags += ["--n-samples-per-prompt", str(args.samples), "--rollout-max-response-len", str(args.tokens)]
    flags += ["--rollout-temperature", str(args.temperature), "--entropy-coef", str(args.entropy_coef)]
    flags += ["--log-probs-chunk-size", str(chunk), "--disable-zero-advantage-skip", "--lr", "1e-6"]
    # one micro-batch of every sample: the step's forward holds all --tokens positions at once (with one sample
    # per micro-batch the full logits would be 1/--samples of them)
    flags += ["--micro-batch-size", str(args.samples)]
    work = os.path.dirname(ckpt)
    prompts = os.path.join(work, "prompts.jsonl")  # required by the flags; the step's samples are made here
    with open(prompts, "w", encoding="utf-8") as f:
        f.write(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    flags += ["--prompt-data", prompts, "--rm-type", "math", "--output-dir", os.path.join(work, "out"), "--no-progress"]
    cli = parse_train_args(flags)
    actor = TrainActor(TrainerConfig.from_args(cli), plugin_args=cli)
    rng = random.Random(0)
    per = args.tokens // args.samples
    samples = [
        Sample(
            tokens=[rng.randrange(3, args.vocab) for _ in range(16 + per)],
            response_length=per,
            reward=i / args.samples,
            status=Status.COMPLETED,
            group_index=0,
            index=i,
        )
        for i in range(args.samples)
    ]
    actor.train(0, [samples])  # warm-up: Adam's state
    steps = []
    for r in range(args.repeats):
        before = _status_kb("VmRSS")
        _reset_peak()
        t = time.perf_counter()
        actor.train(r + 1, [samples])
        seconds = time.perf_counter() - t
        steps.append({"seconds": seconds, "peak_bytes": (_status_kb("VmHWM") - before) * 1024})
    return {"chunk_size": chunk, "steps": steps, "resident_bytes": _status_kb("VmRSS") * 1024}


def _spawn(args: argparse.Namespace, ckpt: str, chunk: int, argv: list[str]) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "lichen_bench.log_probs", *argv, "--child", f"{ckpt}::{chunk}"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"variant --log-probs-chunk-size {chunk} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _load() -> float:
    return os.getloadavg()[0]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        ckpt, chunk = args.child.rsplit("::", 1)
        print(json.dumps(run_child(args, ckpt, int(chunk))))
        return 0
    from lichen_bench.machine import code_version, machine_info

    work = args.work_dir or tempfile.mkdtemp(prefix="lichen-bench-logprobs-")
    ckpt = make_checkpoint(os.path.join(work, "checkpoint"), args)
    variants = {"full": -1, "chunked": args.chunk_size}
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    load_before = _load()
    for r in range(args.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            print(f"round {r + 1}/{args.rounds}: {name} (--log-probs-chunk-size {variants[name]}) ...", flush=True)
            runs[name].append(_spawn(args, ckpt, variants[name], argv))
    load_after = _load()
    med = {}
    for name, children in runs.items():
        steps = [s for c in children for s in c["steps"]]
        med[name] = {
            "seconds": statistics.median(s["seconds"] for s in steps),
            "peak_bytes": statistics.median(s["peak_bytes"] for s in steps),
            "steps": len(steps),
        }
    ratios = {k: med["chunked"][k] / med["full"][k] for k in ("seconds", "peak_bytes")}
    print(
        f"\nvocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, {args.tokens} response tokens in "
        f"{args.samples} samples, T={args.temperature}, entropy coef {args.entropy_coef}, {args.threads} threads"
    )
    print(f"{'variant':<26}{'step s (median)':>17}{'step peak GB (median)':>24}{'steps':>7}")
    for name, chunk in variants.items():
        m = med[name]
        label = f"{name} (chunk {chunk})"
        print(f"{label:<26}{m['seconds']:>17.2f}{m['peak_bytes'] / 1e9:>24.3f}{m['steps']:>7}")
    print(
        f"ratio chunked / full: step time {ratios['seconds']:.3f} (target <= 1.1), peak memory "
        f"{ratios['peak_bytes']:.3f} (target <= 0.25)"
    )
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"1-minute load average: {load_before:.1f} before, {load_after:.1f} after ({cpus} CPUs)")
    if max(load_before, load_after) > args.threads:
        print(f"!! WARNING: load above the {args.threads} threads this benchmark uses: other work competed")
    if args.json:
        report = {
            "settings": vars(args),
            "runs": runs,
            "medians": med,
            "ratios": ratios,
            "load": [load_before, load_after],
            "machine": machine_info(),
            "code": code_version(),
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
