"""The agentic demo's driver (its plug-ins and what it does: agentic_calculator.py, which runs it): the data, each
stage as a plain `lichen` command in a child process, the stopping rule, and the summary.

    .venv/bin/python examples/agentic_calculator.py [--seed 1] [--workdir runs/agentic] [--quiet]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from agentic_calculator import (  # noqa: E402
    EVAL_NAME,
    PARSER,
    SFT_EVAL_NAME,
    TOOL,
)
from quickstart import StageFailed, eval_curve, fmt_curve, metric_curve, run_stage  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Tiny model, calculator tool: SFT on tool traces then GRPO, against the "
        "same model trained without the tool; prints held-out accuracy of both.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--seed", type=int, default=1, help="seed of the model init, the data and sampling")
    p.add_argument(
        "--workdir", default="runs/agentic", help="where models, data, logs and checkpoints go (<workdir>/seed<N>)"
    )
    p.add_argument("--quiet", action="store_true", help="print only stage headers and the summary")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads of each training process")
    p.add_argument("--digits", type=int, default=4, help="digits of each operand")
    p.add_argument("--train-problems", type=int, default=20000, help="training prompts")
    p.add_argument("--heldout", type=int, default=200, help="held-out problems (never trained on)")
    p.add_argument("--sft-steps", type=int, default=1000, help="at most this many SFT optimizer steps per arm")
    p.add_argument(
        "--sft-stop-accuracy",
        type=float,
        default=0.4,
        help="SFT stops at the first eval whose greedy "
        "accuracy on the SFT-eval split reaches this (that step's checkpoint starts RL), so RL starts "
        "from a partly-right model on every seed; an arm that never reaches it trains --sft-steps",
    )
    p.add_argument("--sft-eval-every", type=int, default=5, help="SFT-eval (and checkpoint) every N SFT steps")
    p.add_argument(
        "--sft-eval-problems",
        type=int,
        default=100,
        help="problems of the SFT-eval split (apart from the training and held-out test problems)",
    )
    p.add_argument("--sft-batch", type=int, default=32, help="problems per SFT step")
    p.add_argument(
        "--mix-steps",
        type=int,
        default=150,
        help="tool arm, stage 2: SFT steps on the cold-start mix (from stage 1's stop checkpoint; 0 skips the stage)",
    )
    p.add_argument(
        "--mix-tool-fraction",
        type=float,
        default=0.5,
        help="share of training problems whose cold-start trace calls the tool (the others answer from memory)",
    )
    p.add_argument("--sft-lr", type=float, default=1e-3, help="SFT learning rate (constant; both SFT stages)")
    p.add_argument("--rl-steps", type=int, default=30, help="GRPO steps of each arm")
    p.add_argument("--rl-prompts", type=int, default=16, help="prompts per GRPO step")
    p.add_argument("--rl-group", type=int, default=8, help="samples per prompt")
    p.add_argument("--rl-lr", type=float, default=1e-4, help="GRPO peak learning rate (cosine decay to 0)")
    p.add_argument(
        "--rl-temperature",
        type=float,
        default=0.7,
        help="rollout sampling temperature (at 1.0 a "
        "partly-right tiny model rarely copies all 13 digits right, so most groups have no signal)",
    )
    p.add_argument("--rl-eval-every", type=int, default=10, help="held-out eval every N GRPO steps")
    p.add_argument(
        "--arms", nargs="+", choices=["tool", "no_tool"], default=["tool", "no_tool"], help="which arms to run"
    )
    args = p.parse_args(argv)
    if not 0.0 <= args.mix_tool_fraction <= 1.0:
        p.error(f"--mix-tool-fraction must be between 0 and 1, got {args.mix_tool_fraction}")
    if args.mix_steps < 0:
        p.error(f"--mix-steps must be 0 (no cold-start stage) or more, got {args.mix_steps}")
    return args


def make_data(args: argparse.Namespace, data_dir: str) -> tuple[str, str, str]:
    """Random distinct problems: (train, held-out test, SFT-eval) files; no problem is in two of them."""
    rng = random.Random(args.seed)
    # Sums of --digits or one more digits: the answer's copy of the result then sits at one of two offsets, which
    # keeps SFT partly right after its budget (with operands below half the range, every sum the same length,
    # SFT reached 100% held-out on seed 2 and left RL nothing to do).
    lo, hi = 10 ** (args.digits - 1), 10**args.digits - 1
    seen: set[tuple[int, int]] = set()
    n_test, n_stop = args.heldout, args.sft_eval_problems
    while len(seen) < args.train_problems + n_test + n_stop:
        seen.add((rng.randint(lo, hi), rng.randint(lo, hi)))
    pairs = sorted(seen)
    rng.shuffle(pairs)
    os.makedirs(data_dir, exist_ok=True)
    paths = tuple(os.path.join(data_dir, f"{name}.jsonl") for name in ("train", "heldout", SFT_EVAL_NAME))
    splits = pairs[n_test + n_stop :], pairs[:n_test], pairs[n_test : n_test + n_stop]
    for path, rows in zip(paths, splits):
        with open(path, "w") as f:
            for a, b in rows:
                row: dict = {"prompt": f"{a}+{b}=", "label": str(a + b)}
                if path == paths[0]:  # the kind of the cold-start trace of this training problem (drawn once)
                    row["metadata"] = {"sft_trace": "tool" if rng.random() < args.mix_tool_fraction else "direct"}
                f.write(json.dumps(row) + "\n")
    return paths


def arm_flags(arm: str) -> tuple[list[str], int]:
    """The flags that make an arm (the tool rollout or none) and its response budget in tokens."""
    if arm == "tool":  # call (~23 tokens) + tool turn (~25) + answer (~6)
        return ["--tool-paths", TOOL, "--tool-call-parser", PARSER, "--max-turns", "3", "--check-token-fidelity"], 64
    return [], 8


def common(args: argparse.Namespace, train: str) -> list[str]:
    return [
        "--device",
        "cpu",
        "--num-threads",
        str(args.threads),
        "--seed",
        str(args.seed),
        "--prompt-data",
        train,
        "--rollout-shuffle",
        "--rollout-seed",
        str(args.seed),
        "--apply-chat-template",
        "--custom-rm-path",
        "agentic_calculator.reward",
        "--no-progress",
    ]


def sft_argv(
    args,
    arm: str,
    model: str,
    out: str,
    train: str,
    sft_eval: str,
    rollout: str | None = None,
    steps: int | None = None,
    every: int | None = None,
) -> list[str]:
    """Stage 1 of an arm (the defaults) or, with `rollout`, `steps` and `every` given, the tool arm's stage 2."""
    flags, budget = arm_flags(arm)
    rollout = rollout or ("agentic_calculator.sft_rollout" if arm == "tool" else "lichen.rollout.sft.generate_rollout")
    steps, every = steps or args.sft_steps, every or args.sft_eval_every
    # Eval on the SFT-eval split and a checkpoint at the same steps (the loop saves before it evaluates), so the
    # early stop can start RL from exactly the model it measured. The test set's accuracy of that model is the
    # RL stage's eval before its first step.
    return [
        "train",
        "--hf-checkpoint",
        model,
        *common(args, train),
        *flags,
        "--eval-prompt-data",
        SFT_EVAL_NAME,
        sft_eval,
        "--eval-temperature",
        "0",
        "--eval-max-response-len",
        str(budget),
        "--eval-interval",
        str(every),
        "--skip-eval-before-train",
        "--loss-type",
        "sft_loss",
        "--rollout-function-path",
        rollout,
        "--disable-rewards-normalization",
        "--rollout-batch-size",
        str(args.sft_batch),
        "--n-samples-per-prompt",
        "1",
        "--micro-batch-size",
        str(args.sft_batch),
        "--num-rollout",
        str(steps),
        "--lr",
        str(args.sft_lr),
        "--save",
        os.path.join(out, "checkpoints"),
        "--save-interval",
        str(every),
        "--output-dir",
        out,
    ]


def rl_argv(args, arm: str, start: str, out: str, train: str, heldout: str) -> list[str]:
    flags, budget = arm_flags(arm)
    dump = ["--save-debug-rollout-data", os.path.join(out, "rollouts", "r_{rollout_id}.pt")] if arm == "tool" else []
    return [
        "train",
        "--hf-checkpoint",
        start,
        *common(args, train),
        *flags,
        *dump,
        "--eval-prompt-data",
        EVAL_NAME,
        heldout,
        "--eval-temperature",
        "0",
        "--eval-max-response-len",
        str(budget),
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
        str(budget),
        "--num-rollout",
        str(args.rl_steps),
        "--lr",
        str(args.rl_lr),
        "--lr-decay-style",
        "cosine",
        "--eval-interval",
        str(args.rl_eval_every),
        "--log-samples",
        "8",
        "--output-dir",
        out,
    ]


def trajectories(rollout_dir: str) -> dict:
    """Tool use and the token-fidelity check over every trajectory the tool arm's RL trained on."""
    from lichen.torch_files import load_plain

    total = called = mismatched = 0
    first = None
    for name in sorted(os.listdir(rollout_dir)):
        for s in (s for g in load_plain(os.path.join(rollout_dir, name), "rollout dump")["samples"] for s in g):
            md = s.get("metadata") or {}
            total += 1
            called += bool(md.get("tool_calls"))
            if md.get("token_fidelity") is not None:
                mismatched += 1
                first = first or {"file": name, "index": s.get("index"), **md["token_fidelity"]}
    return {"trajectories": total, "with_tool_call": called, "fidelity_mismatches": mismatched, "first_mismatch": first}


def stop_step(curve: list[tuple[int, float]], target: float) -> int | None:
    """The early-stop rule: the first eval step whose accuracy reaches `target` (None: not reached yet)."""
    return next((step for step, acc in curve if acc >= target), None)


class EarlyStop:
    """Watches an SFT run's output; at each eval line it re-reads the SFT-eval curve and asks `stop_step`."""

    def __init__(self, metrics_path: str, target: float) -> None:
        self.metrics_path, self.target = metrics_path, target
        self.step: int | None = None

    def __call__(self, line: str) -> bool:
        if not (line.startswith("step ") and " eval " in line):
            return False
        self.step = stop_step(eval_curve(self.metrics_path, SFT_EVAL_NAME), self.target)
        return self.step is not None


def checkpoint_at(ckpt_dir: str, step: int) -> str:
    """The HF export saved after `step` SFT steps (rollout id step - 1)."""
    hf = os.path.join(ckpt_dir, f"iter_{step - 1:07d}", "hf")
    if not os.path.isfile(os.path.join(hf, "config.json")):
        raise StageFailed(f"SFT checkpoint {hf} has no config.json")
    return hf


def run_arm(args, arm: str, model: str, root: str, data: tuple[str, str, str], times: dict, cpu: dict) -> dict:
    train, heldout, sft_eval = data
    sft_out, rl_out = os.path.join(root, f"{arm}_sft"), os.path.join(root, f"{arm}_rl")
    print(
        f"\n== {arm}: SFT (at most {args.sft_steps} steps x {args.sft_batch}; stops at "
        f"{100 * args.sft_stop_accuracy:g}% on the SFT-eval split)",
        flush=True,
    )
    stop = EarlyStop(os.path.join(sft_out, "metrics.jsonl"), args.sft_stop_accuracy)
    sft = sft_argv(args, arm, model, sft_out, train, sft_eval)
    times[f"{arm}_sft"], cpu[f"{arm}_sft"] = run_stage(
        f"{arm}_sft", sft, os.path.join(root, f"{arm}_sft.log"), args.quiet, args.threads, stop=stop
    )
    sft_steps = stop.step or args.sft_steps
    # up to the stop: an eval the run logged before it was cut off measured a model RL does not start from
    sft_curve = [
        (step, acc)
        for step, acc in eval_curve(os.path.join(sft_out, "metrics.jsonl"), SFT_EVAL_NAME)
        if step <= sft_steps
    ]
    start = checkpoint_at(os.path.join(sft_out, "checkpoints"), sft_steps)
    print(f"   SFT-eval curve {fmt_curve(sft_curve)}; stopped at step {sft_steps}", flush=True)
    out: dict = {"sft_steps": sft_steps, "sft_stopped_early": stop.step is not None, "sft_eval_curve": sft_curve}
    if arm == "tool" and args.mix_steps > 0:
        mix_out = os.path.join(root, "tool_mix")
        print(
            f"== tool: SFT on the cold-start mix ({args.mix_steps} steps x {args.sft_batch}; "
            f"{100 * args.mix_tool_fraction:g}% of the traces call the tool)",
            flush=True,
        )
        mix = sft_argv(
            args,
            arm,
            start,
            mix_out,
            train,
            sft_eval,
            rollout="agentic_calculator.mixed_sft_rollout",
            steps=args.mix_steps,
            every=args.mix_steps,
        )
        times["tool_mix"], cpu["tool_mix"] = run_stage(
            "tool_mix", mix, os.path.join(root, "tool_mix.log"), args.quiet, args.threads
        )
        start = checkpoint_at(os.path.join(mix_out, "checkpoints"), args.mix_steps)
        out["mix_steps"] = args.mix_steps
        out["mix_sft_eval"] = eval_curve(os.path.join(mix_out, "metrics.jsonl"), SFT_EVAL_NAME)[-1][1]
    print(f"== {arm}: GRPO {args.rl_steps} steps x {args.rl_prompts} prompts x {args.rl_group} samples", flush=True)
    times[f"{arm}_rl"], cpu[f"{arm}_rl"] = run_stage(
        f"{arm}_rl",
        rl_argv(args, arm, start, rl_out, train, heldout),
        os.path.join(root, f"{arm}_rl.log"),
        args.quiet,
        args.threads,
    )
    metrics = os.path.join(rl_out, "metrics.jsonl")
    curve = eval_curve(metrics)
    if curve[0][0] != 0:
        raise StageFailed(f"{arm}: the RL stage logged no eval before training")
    out.update(sft_accuracy=curve[0][1], rl_accuracy=curve[-1][1], rl_curve=curve)
    if arm == "tool":
        # greedy held-out answers that called the tool, and the sampled RL trajectories that did, per step
        out["heldout_tool_call_curve"] = metric_curve(metrics, f"eval/{EVAL_NAME}/tool_call_ratio")
        out["rollout_tool_call_ratio"] = metric_curve(metrics, "rollout/tool_call_ratio")
        out.update(trajectories(os.path.join(rl_out, "rollouts")))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = os.path.abspath(os.path.join(args.workdir, f"seed{args.seed}"))
    os.makedirs(root, exist_ok=True)
    for name in os.listdir(root):  # metrics.jsonl files are appended to: start clean
        path = os.path.join(root, name)
        if os.path.isdir(path):
            import shutil

            shutil.rmtree(path)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)
    times: dict[str, float] = {}
    cpu: dict[str, float] = {}
    t0 = time.perf_counter()
    model = os.path.join(root, "model")
    try:
        times["model"], cpu["model"] = run_stage(
            "model",
            ["make-tiny-model", model, "--seed", str(args.seed)],
            os.path.join(root, "model.log"),
            args.quiet,
            args.threads,
        )
        data = make_data(args, os.path.join(root, "data"))
        arms = {arm: run_arm(args, arm, model, root, data, times, cpu) for arm in args.arms}
    except StageFailed as e:
        print(f"\nagentic_calculator: error: {e}", file=sys.stderr)
        return 1
    times["total"] = time.perf_counter() - t0
    summary = {
        "seed": args.seed,
        "heldout_problems": args.heldout,
        "arms": arms,
        "seconds": times,
        "cpu_seconds": cpu,
        "settings": {k: v for k, v in vars(args).items() if k not in ("workdir", "quiet")},
    }
    if "tool" in arms:
        tool = arms["tool"]
        summary["tool_gain_points"] = 100 * (tool["rl_accuracy"] - tool["sft_accuracy"])
        if "no_tool" in arms:
            summary["tool_minus_no_tool_points"] = 100 * (tool["rl_accuracy"] - arms["no_tool"]["rl_accuracy"])
    with open(os.path.join(root, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"\n== summary (seed {args.seed}, {args.heldout} held-out problems, greedy)")
    for arm, r in arms.items():
        steps = f"{r['sft_steps']} + {r['mix_steps']} mix" if "mix_steps" in r else str(r["sft_steps"])
        print(
            f"  {arm:8s} held-out accuracy: SFT ({steps} steps) {100 * r['sft_accuracy']:5.1f}%  ->  "
            f"RL {100 * r['rl_accuracy']:5.1f}%"
            f"   (curve {fmt_curve(r['rl_curve'])})"
        )
    if "tool" in arms:
        t = arms["tool"]
        calls, sampled = t["heldout_tool_call_curve"], [v for _, v in t["rollout_tool_call_ratio"]]
        print(
            f"  tool arm: held-out answers that called the tool {fmt_curve(calls)}; sampled RL trajectories "
            f"that did: {100 * sampled[0]:.0f}% at step 1, {100 * sampled[-1]:.0f}% at step {len(sampled)}"
        )
        print(
            f"  tool arm: {t['with_tool_call']}/{t['trajectories']} RL trajectories called the tool; token "
            f"fidelity: {t['fidelity_mismatches']} mismatching trajectories"
            + (f" (first: {t['first_mismatch']})" if t["first_mismatch"] else "")
        )
        print(
            f"  gain of the tool arm over its SFT start: {summary['tool_gain_points']:+.1f} points"
            + (
                f"; tool minus no-tool after RL: {summary['tool_minus_no_tool_points']:+.1f} points"
                if "tool_minus_no_tool_points" in summary
                else ""
            )
        )
    print(
        "  wall time: "
        + ", ".join(f"{k} {v:.0f}s" for k, v in times.items())
        + "  (CPU: "
        + ", ".join(f"{k} {v:.0f}s" for k, v in cpu.items())
        + ")"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
