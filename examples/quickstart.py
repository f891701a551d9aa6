"""Quick start: from nothing to a tiny model whose RL measurably helps, on a laptop CPU in about three minutes.

    .venv/bin/python examples/quickstart.py [--seed 1] [--workdir runs/quickstart] [--quiet]

The task is two-digit addition ("37+58=" -> "95"), checked by a rule reward (`--rm-type leading_number`: 1 iff
the response's leading integer equals the label). Four stages, each a plain `lichen` command run as a child
process, so every step is something you can type yourself (examples/tiny_cpu_grpo.sh is the same run as a
shell script):

  1. `lichen make-tiny-model`: a random-init llama-style model (2 layers, width 64, 138k parameters) with a
     one-token-per-character tokenizer.
  2. data: every pair (a, b) with 0 <= a, b <= 99, shuffled by --seed; the first --heldout pairs are the
     held-out set, the other 9,500 are training prompts. The two sets share no problem.
  3. SFT warm-up: `lichen train --loss-type sft_loss --rollout-function-path lichen.rollout.sft.generate_rollout`
     (the label is the response). It stops while the model is partly right (50-78% held-out on 11 of 12
     seeds) so RL has room.
  4. GRPO from the SFT checkpoint: G = 8 samples per prompt at temperature 1, reward 1/0, advantage
     A_i = (r_i - mean_j r_j) / (std_j r_j + eps) within each prompt's group, PPO-clipped policy loss, learning
     rate 1e-4 decaying to 0 (cosine). Held-out accuracy (greedy decoding) is evaluated before the first RL
     step -- that is the SFT model's accuracy -- and every --rl-eval-every steps after.

It prints held-out accuracy after SFT and after RL, the gain in points and the wall (and CPU) time of each stage,
writes them to <workdir>/summary.json, and exits 1 when a stage fails.

Settings were chosen by measurement (see docs/quickstart.md): a learning rate of 3e-3 for SFT left most seeds
stuck near 10% for 800-1,500 steps; RL started from that plateau gained -2 to +6 points, while RL started from a
partly-right model (25-75%) gained 14-30 points, most of it within 25 steps. RL learning rates of 3e-4 and 1e-3
did worse than 1e-4. Training uses one CPU thread by default: a tiny model's matrices are too small for two
threads to pay off much, and one thread keeps its speed when other processes share the machine (two spinning
threads slowed down 2-4x there).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

EVAL_NAME = "heldout"


# ------------------------------------------------------------------------------------------------ settings


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Tiny model -> SFT warm-up -> GRPO on two-digit addition; prints held-out accuracy before "
        "and after RL.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--seed", type=int, default=1, help="seed of the model init, the data split and sampling")
    p.add_argument("--workdir", default="runs/quickstart", help="where the model, data, logs and checkpoints go")
    p.add_argument(
        "--quiet",
        action="store_true",
        help="print only stage headers and the summary (by default the "
        "steps with an eval are printed too; full logs are always in <workdir>/<stage>.log)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads of each training process")
    g = p.add_argument_group("task and model")
    g.add_argument("--max-operand", type=int, default=99, help="operands are 0..N")
    g.add_argument("--heldout", type=int, default=500, help="held-out problems (never trained on)")
    g.add_argument("--hidden-size", type=int, default=64, help="model width")
    g.add_argument("--num-layers", type=int, default=2, help="decoder layers")
    g.add_argument("--num-heads", type=int, default=4, help="attention heads")
    g.add_argument("--intermediate-size", type=int, default=256, help="MLP inner width")
    g = p.add_argument_group("SFT warm-up")
    g.add_argument("--sft-steps", type=int, default=1000, help="optimizer steps (one batch each)")
    g.add_argument("--sft-batch", type=int, default=64, help="problems per step")
    g.add_argument("--sft-lr", type=float, default=1e-3, help="constant learning rate")
    g.add_argument("--sft-eval-every", type=int, default=100, help="held-out eval every N steps")
    g = p.add_argument_group("GRPO")
    g.add_argument("--rl-steps", type=int, default=150, help="rollout steps (one optimizer step each)")
    g.add_argument("--rl-prompts", type=int, default=64, help="prompts per rollout step (--rollout-batch-size)")
    g.add_argument("--rl-group", type=int, default=8, help="samples per prompt (--n-samples-per-prompt)")
    g.add_argument("--rl-lr", type=float, default=1e-4, help="peak learning rate")
    g.add_argument(
        "--rl-lr-decay",
        choices=["constant", "linear", "cosine"],
        default="cosine",
        help="learning-rate schedule over the RL steps (decays to 0)",
    )
    g.add_argument("--rl-temperature", type=float, default=1.0, help="rollout sampling temperature")
    g.add_argument("--rl-eval-every", type=int, default=25, help="held-out eval every N steps")
    args = p.parse_args(argv)
    if args.max_operand < 1 or (args.max_operand + 1) ** 2 < 2 * args.heldout:
        p.error(f"--max-operand {args.max_operand} gives too few problems for --heldout {args.heldout}")
    return args


# -------------------------------------------------------------------------------------------------- stages


@dataclass
class Paths:
    root: str

    def __post_init__(self) -> None:
        self.model = os.path.join(self.root, "model")
        self.data = os.path.join(self.root, "data")
        self.train = os.path.join(self.data, "train.jsonl")
        self.heldout = os.path.join(self.data, "heldout.jsonl")
        self.sft = os.path.join(self.root, "sft")  # --output-dir of the SFT run (metrics.jsonl)
        self.sft_ckpt = os.path.join(self.sft, "checkpoints")
        self.rl = os.path.join(self.root, "rl")
        self.summary = os.path.join(self.root, "summary.json")

    def fresh(self) -> None:
        """Remove what an earlier run left: metrics.jsonl is appended to, so stale lines would mix in."""
        for path in (self.model, self.data, self.sft, self.rl, self.summary):
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)
        os.makedirs(self.root, exist_ok=True)


class StageFailed(RuntimeError):
    pass


def run_stage(
    name: str, argv: list[str], log_path: str, quiet: bool, threads: int, stop: Callable[[str], bool] | None = None
) -> tuple[float, float]:
    """Run `python -m lichen.cli ARGV`, teeing its output to log_path; returns (wall, CPU) seconds.

    CPU seconds (user + system of the child) are printed beside wall time because they do not grow when other
    processes share the cores, so a slow wall time on a busy machine can be told apart from a slow run.
    `stop(line)`, when given, sees each output line; once it returns True the child is terminated and the stage
    counts as done (a run that stops itself on a condition it reads from its own output, e.g. an eval).
    """
    cmd = [sys.executable, "-m", "lichen.cli", *argv]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    t0, c0 = time.perf_counter(), os.times()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        assert proc.stdout is not None
        tail: list[str] = []
        stopped = False
        for line in proc.stdout:
            log.write(line)
            tail = (tail + [line])[-20:]
            if stop is not None and not stopped and stop(line):
                stopped = True
                proc.terminate()
            # Step lines only when they carry an eval; anything else (warnings, errors) always.
            if not quiet and (not line.startswith("step ") or " eval " in line):
                print("  " + line, end="", flush=True)
        rc = proc.wait()
    if rc != 0 and not stopped:
        if quiet:
            sys.stdout.write("".join("  " + t for t in tail))
        raise StageFailed(f"stage {name!r} failed (exit {rc}); full log: {log_path}")
    c1 = os.times()
    cpu = (c1.children_user + c1.children_system) - (c0.children_user + c0.children_system)
    return time.perf_counter() - t0, cpu


def make_data(args: argparse.Namespace, paths: Paths) -> tuple[int, int]:
    """All (a, b) pairs shuffled by the seed; the first --heldout are held out. Returns (n_train, n_heldout)."""
    n = args.max_operand + 1
    pairs = [(a, b) for a in range(n) for b in range(n)]
    random.Random(args.seed).shuffle(pairs)
    heldout, train = pairs[: args.heldout], pairs[args.heldout :]
    os.makedirs(paths.data, exist_ok=True)
    for path, rows in ((paths.heldout, heldout), (paths.train, train)):
        with open(path, "w") as f:
            for a, b in rows:
                f.write(json.dumps({"prompt": f"{a}+{b}=", "label": str(a + b)}) + "\n")
    return len(train), len(heldout)


def common_flags(args: argparse.Namespace, paths: Paths) -> list[str]:
    return [
        "--device",
        "cpu",
        "--num-threads",
        str(args.threads),
        "--seed",
        str(args.seed),
        "--prompt-data",
        paths.train,
        "--rollout-shuffle",
        "--rollout-seed",
        str(args.seed),
        "--rm-type",
        "leading_number",
        "--eval-prompt-data",
        EVAL_NAME,
        paths.heldout,
        "--eval-temperature",
        "0",  # greedy
        "--eval-max-response-len",
        "5",  # "198" + eos needs 4
        "--no-progress",
    ]


def sft_argv(args: argparse.Namespace, paths: Paths) -> list[str]:
    return [
        "train",
        "--hf-checkpoint",
        paths.model,
        *common_flags(args, paths),
        "--loss-type",
        "sft_loss",
        "--rollout-function-path",
        "lichen.rollout.sft.generate_rollout",
        "--disable-rewards-normalization",  # no rewards in SFT; needed while group size is 1
        "--rollout-batch-size",
        str(args.sft_batch),
        "--n-samples-per-prompt",
        "1",
        "--micro-batch-size",
        str(args.sft_batch),
        "--num-rollout",
        str(args.sft_steps),
        "--lr",
        str(args.sft_lr),
        "--eval-interval",
        str(args.sft_eval_every),
        "--save",
        paths.sft_ckpt,
        "--save-interval",
        str(args.sft_steps),
        "--output-dir",
        paths.sft,
    ]


def rl_argv(args: argparse.Namespace, paths: Paths, start: str) -> list[str]:
    return [
        "train",
        "--hf-checkpoint",
        start,
        *common_flags(args, paths),
        "--advantage-estimator",
        "grpo",
        "--rollout-batch-size",
        str(args.rl_prompts),
        "--n-samples-per-prompt",
        str(args.rl_group),
        "--micro-batch-size",
        str(args.rl_prompts * args.rl_group),
        "--rollout-temperature",
        str(args.rl_temperature),
        "--rollout-max-response-len",
        "5",
        "--num-rollout",
        str(args.rl_steps),
        "--lr",
        str(args.rl_lr),
        "--lr-decay-style",
        args.rl_lr_decay,
        "--eval-interval",
        str(args.rl_eval_every),
        "--output-dir",
        paths.rl,
    ]


# ------------------------------------------------------------------------------------------------- results


def metric_curve(metrics_path: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of every metrics.jsonl row that logged `key`."""
    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f]
    return [(int(r["step"]), float(r[key])) for r in rows if r.get(key) is not None]


def eval_curve(metrics_path: str, name: str = EVAL_NAME) -> list[tuple[int, float]]:
    """(rollout steps done, accuracy on eval set `name`) for each eval logged in metrics.jsonl."""
    key = f"eval/{name}/reward_mean"
    curve = metric_curve(metrics_path, key)
    if not curve:
        raise StageFailed(f"{metrics_path}: no {key} logged")
    return curve


def sft_checkpoint(paths: Paths) -> str:
    marker = os.path.join(paths.sft_ckpt, "latest_checkpointed_iteration.txt")
    if not os.path.isfile(marker):
        raise StageFailed(f"SFT stage wrote no checkpoint ({marker} is missing)")
    with open(marker) as f:
        rollout_id = int(f.read().strip())
    hf = os.path.join(paths.sft_ckpt, f"iter_{rollout_id:07d}", "hf")
    if not os.path.isfile(os.path.join(hf, "config.json")):
        raise StageFailed(f"SFT checkpoint {hf} has no config.json")
    return hf


def fmt_curve(curve: list[tuple[int, float]]) -> str:
    return "  ".join(f"{step}:{100 * acc:.1f}%" for step, acc in curve)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    paths = Paths(os.path.abspath(args.workdir))
    paths.fresh()
    times: dict[str, float] = {}  # wall seconds per stage
    cpu: dict[str, float] = {}  # CPU seconds per stage
    t_start, c_start = time.perf_counter(), time.process_time()

    def header(text: str) -> None:
        print(f"\n== {text}", flush=True)

    try:
        header(f"1/4 tiny model -> {paths.model}")
        times["model"], cpu["model"] = run_stage(
            "model",
            [
                "make-tiny-model",
                paths.model,
                "--arch",
                "llama",
                "--hidden-size",
                str(args.hidden_size),
                "--num-layers",
                str(args.num_layers),
                "--num-heads",
                str(args.num_heads),
                "--intermediate-size",
                str(args.intermediate_size),
                "--seed",
                str(args.seed),
            ],
            os.path.join(paths.root, "model.log"),
            args.quiet,
            args.threads,
        )

        header(f"2/4 data -> {paths.data}")
        t0, c0 = time.perf_counter(), time.process_time()
        n_train, n_heldout = make_data(args, paths)
        times["data"], cpu["data"] = time.perf_counter() - t0, time.process_time() - c0
        print(f"  {n_train} training problems, {n_heldout} held-out problems (a+b, 0 <= a, b <= {args.max_operand})")

        header(f"3/4 SFT warm-up: {args.sft_steps} steps x {args.sft_batch} problems, lr {args.sft_lr}")
        times["sft"], cpu["sft"] = run_stage(
            "sft", sft_argv(args, paths), os.path.join(paths.root, "sft.log"), args.quiet, args.threads
        )
        sft_curve = eval_curve(os.path.join(paths.sft, "metrics.jsonl"))
        start = sft_checkpoint(paths)

        header(
            f"4/4 GRPO: {args.rl_steps} steps x {args.rl_prompts} prompts x {args.rl_group} samples, "
            f"lr {args.rl_lr} ({args.rl_lr_decay}), temperature {args.rl_temperature}"
        )
        times["rl"], cpu["rl"] = run_stage(
            "rl", rl_argv(args, paths, start), os.path.join(paths.root, "rl.log"), args.quiet, args.threads
        )
        rl_curve = eval_curve(os.path.join(paths.rl, "metrics.jsonl"))
    except StageFailed as e:
        print(f"\nquickstart: error: {e}", file=sys.stderr)
        return 1
    times["total"] = time.perf_counter() - t_start
    # the child processes plus this one (data generation, reading metrics)
    cpu["total"] = cpu["model"] + cpu["sft"] + cpu["rl"] + (time.process_time() - c_start)

    if rl_curve[0][0] != 0:
        print("quickstart: error: the RL stage logged no eval before training", file=sys.stderr)
        return 1
    sft_acc, rl_acc = rl_curve[0][1], rl_curve[-1][1]
    if sft_curve[-1][0] == args.sft_steps and abs(sft_curve[-1][1] - sft_acc) > 1e-9:
        # Same weights, greedy decoding, same eval batch: the two numbers must agree.
        print(
            f"quickstart: warning: SFT's last eval ({sft_curve[-1][1]:.3f}) differs from the RL stage's eval "
            f"before training ({sft_acc:.3f})",
            file=sys.stderr,
        )
    delta = 100 * (rl_acc - sft_acc)
    summary = {
        "seed": args.seed,
        "heldout_problems": n_heldout,
        "sft_accuracy": sft_acc,
        "rl_accuracy": rl_acc,
        "delta_points": delta,
        "sft_curve": sft_curve,
        "rl_curve": rl_curve,
        "seconds": times,
        "cpu_seconds": cpu,
        "settings": {k: v for k, v in vars(args).items() if k not in ("workdir", "quiet")},
    }
    with open(paths.summary, "w") as f:
        json.dump(summary, f, indent=1)

    header(f"summary (seed {args.seed}, {n_heldout} held-out problems, greedy decoding)")
    print(f"  SFT curve (step:acc)  {fmt_curve(sft_curve)}")
    print(f"  RL curve  (step:acc)  {fmt_curve(rl_curve)}")
    print(f"  held-out accuracy after SFT : {100 * sft_acc:5.1f}%")
    print(f"  held-out accuracy after RL  : {100 * rl_acc:5.1f}%   ({delta:+.1f} points)")
    print(
        f"  wall time: model {times['model']:.0f}s, SFT {times['sft']:.0f}s, RL {times['rl']:.0f}s, "
        f"total {times['total']:.0f}s (CPU time: SFT {cpu['sft']:.0f}s, RL {cpu['rl']:.0f}s, "
        f"total {cpu['total']:.0f}s)"
    )
    print(f"  details: {paths.summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
