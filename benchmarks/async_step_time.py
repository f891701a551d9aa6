"""Step time of `lichen train --async` against the synchronous loop, in the same invocation (docs/async.md).

    .venv/bin/python benchmarks/async_step_time.py [--steps 10] [--warmup 2] [--workdir runs/async_bench]
                                                   [--engine-core 1] [--trainer-core 0] [--modes sync async fully]

One `lichen serve` pinned to --engine-core (taskset) serves both runs; each `lichen train` (synchronous, then
--async) is pinned to --trainer-core, one torch thread each, on a tiny random model and an addition data set
sized so that generation and training cost about the same. The table shows the mean of `time/step` after
--warmup steps, the ratio async / sync, the time each run spends in generate, reward, train and sync
(in the async run generate runs beside train), and the distribution of `train/staleness_max` of the async run. This is a measurement, not a test: on shared cores the
numbers move with the machine's load.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import shutil
import subprocess
import sys

LICHEN = [sys.executable, "-m", "lichen.cli"]
MODE_FLAGS = {"sync": [], "async": ["--async"], "fully": ["--fully-async"]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--workdir", default="runs/async_bench")
    p.add_argument("--engine-core", type=int, default=1)
    p.add_argument("--trainer-core", type=int, default=0)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="--rollout-batch-size (prompts per step)")
    p.add_argument("--n", type=int, default=4, help="--n-samples-per-prompt")
    p.add_argument("--response-len", type=int, default=24)
    p.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODE_FLAGS),
        default=["sync", "async"],
        help="the runs, in order; the first is the baseline of the ratios (fully: --fully-async)",
    )
    p.add_argument(
        "--train-steps",
        type=int,
        default=2,
        help="--num-steps-per-rollout (divides batch x n): makes training cost about what generation does",
    )
    return p.parse_args(argv)


def make_inputs(a: argparse.Namespace) -> tuple[str, str]:
    model, data = os.path.join(a.workdir, "model"), os.path.join(a.workdir, "add.jsonl")
    if not os.path.isdir(model):
        subprocess.run(
            [
                *LICHEN,
                "make-tiny-model",
                model,
                "--hidden-size",
                str(a.hidden_size),
                "--num-layers",
                str(a.num_layers),
                "--num-heads",
                "4",
                "--intermediate-size",
                str(4 * a.hidden_size),
            ],
            check=True,
        )
    rng = random.Random(0)
    with open(data, "w") as f:
        for _ in range(512):
            x, y = rng.randint(0, 99), rng.randint(0, 99)
            f.write(json.dumps({"prompt": f"{x}+{y}=", "label": str(x + y)}) + "\n")
    return model, data


def start_server(a: argparse.Namespace, model: str, weights: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [
            "taskset",
            "-c",
            str(a.engine_core),
            *LICHEN,
            "serve",
            "--model",
            model,
            "--port",
            "0",
            "--num-threads",
            "1",
            "--weight-dir",
            weights,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    for line in proc.stdout:
        m = re.search(r"ready at http://([\w.]+:\d+)", line)
        if m:
            return proc, m.group(1)
    raise SystemExit("lichen serve did not start")


def run_train(a: argparse.Namespace, model: str, data: str, addr: str, weights: str, mode: str) -> list[dict]:
    out = os.path.join(a.workdir, mode)
    shutil.rmtree(out, ignore_errors=True)  # metrics.jsonl appends: a rerun starts from an empty directory
    argv = [
        "taskset",
        "-c",
        str(a.trainer_core),
        *LICHEN,
        "train",
        "--hf-checkpoint",
        model,
        "--prompt-data",
        data,
        "--rm-type",
        "math_lenient",
        "--rollout-batch-size",
        str(a.batch),
        "--n-samples-per-prompt",
        str(a.n),
        "--rollout-max-response-len",
        str(a.response_len),
        "--rollout-shuffle",
        "--lr",
        "1e-4",
        "--num-rollout",
        str(a.steps),
        "--num-steps-per-rollout",
        str(a.train_steps),
        "--num-threads",
        "1",
        "--no-progress",
        "--output-dir",
        out,
        "--rollout-external-engine-addrs",
        addr,
        "--update-weight-transport",
        "disk",
        "--update-weight-disk-dir",
        weights,
        *MODE_FLAGS[mode],
    ]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def mean(xs: list[float]) -> float:
    return sum(xs) / max(len(xs), 1)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    os.makedirs(a.workdir, exist_ok=True)
    model, data = make_inputs(a)
    weights = os.path.abspath(os.path.join(a.workdir, "weights"))
    shutil.rmtree(weights, ignore_errors=True)
    os.makedirs(weights, exist_ok=True)
    server, addr = start_server(a, model, weights)
    try:
        rows = {
            mode: [m for m in run_train(a, model, data, addr, weights, mode) if m.get("step", 0) > a.warmup]
            for mode in a.modes
        }
    finally:
        server.terminate()
        server.wait(timeout=60)
    step = {mode: mean([m["time/step"] for m in rs]) for mode, rs in rows.items()}
    base = a.modes[0]
    print(
        f"steps {a.warmup + 1}..{a.steps} (mean time/step, s):  "
        + "   ".join(f"{mode} {t:.3f}" for mode, t in step.items())
        + "   "
        + "   ".join(f"{mode}/{base} {step[mode] / step[base]:.3f}" for mode in a.modes[1:])
    )
    for mode, rs in rows.items():  # overlapped phases slow each other down where they share a core
        print(
            f"{mode:5s} per step (s): "
            + "  ".join(
                f"{k[5:]} {mean([m.get(k, 0.0) for m in rs]):.3f}"
                for k in ("time/generate", "time/reward", "time/train", "time/sync")
            )
        )
    for mode in [m for m in a.modes if m != "sync"]:
        hist = collections.Counter(m.get("train/staleness_max") for m in rows[mode])
        print(
            f"{mode} train/staleness_max per step:",
            dict(sorted(hist.items())),
            f"mean staleness {mean([m['train/staleness_mean'] for m in rows[mode]]):.3f}",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
