"""`lichen bench learning`: does lichen learn as well as TRL's GRPOTrainer from the same SFT warm start?

The target: on W1 (lichen_bench.workloads), from one SFT warm start, over seeds s = 1..n,
  1. the 95% confidence interval of the mean per-seed difference d_s = L_s - T_s has a lower bound >= -0.05,
     where L_s / T_s are lichen's / TRL's mean reward over steps 11-20 of seed s;
  2. lichen's mean reward over steps 11-20 (averaged over seeds) exceeds its mean over steps 1-2.

Procedure:
  - warm start: `lichen make-tiny-model` (the workload's random-init checkpoint), then SFT with lichen's own
    path (`lichen train --loss-type sft_loss --rollout-function-path lichen.rollout.sft.generate_rollout`) on
    correct sums a+b, 10 <= a, b <= 49 (the W1 prompt range), minus a held-out set on which greedy accuracy is
    measured. SFT stops while the model is partly right, so RL has room; both frameworks load its HF checkpoint.
  - per seed s: the prompt file `make_prompts(wl, steps, seed=s)` and framework seed s, the same for both; lichen
    and TRL run as child processes through lichen_bench.rl (same flags as `lichen bench rl`), the one going
    first alternating by seed; each run's per-step mean reward is read back.

Statistics (paired over seeds, n = number of seeds with both runs):
  d_bar = (1/n) sum d_s,   s_d = sqrt( sum (d_s - d_bar)^2 / (n - 1) ),
  CI95  = d_bar -/+ t_{0.975, n-1} * s_d / sqrt(n),
with the Student-t quantile from `t_quantile` (exact closed-form CDF for integer degrees of freedom).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

from lichen.errors import ConfigError
from lichen_bench import runners
from lichen_bench.machine import fresh_run_dir, load_check, machine_info, overloaded_summary
from lichen_bench.warm_start import add_sft_args, check_sft_args, sft_warm_start

# part of this suite's interface (the tests build the SFT warm start through it); `as` marks the re-export
from lichen_bench.warm_start import sft_flags as sft_flags
from lichen_bench.warm_start import write_sft_data as write_sft_data
from lichen_bench.workloads import WORKLOADS, Workload, make_prompts, model_shape, write_prompts

CI_LOWER_TARGET = -0.05  # the bound on the CI's lower end (docs/performance.md)


# ---- statistics ---------------------------------------------------------------------------------------------
def t_two_sided_mass(t: float, dof: int) -> float:
    """P(|T| <= t) for Student's T with integer `dof` >= 1, in closed form (Abramowitz & Stegun 26.7.3-4).

    With theta = atan(t / sqrt(dof)), c = cos(theta), s = sin(theta):
      dof odd:  (2/pi) * (theta + s * (c + (2/3) c^3 + (2*4)/(3*5) c^5 + ... + up to c^(dof-2)))   (dof = 1: 2 theta/pi)
      dof even: s * (1 + (1/2) c^2 + (1*3)/(2*4) c^4 + ... + up to c^(dof-2))
    """
    if dof < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {dof}")
    theta = math.atan(abs(t) / math.sqrt(dof))
    c, s = math.cos(theta), math.sin(theta)
    if dof % 2 == 1:
        total, term = 0.0, c
        for k in range(1, (dof - 1) // 2 + 1):  # terms c^1, c^3, ..., c^(dof-2)
            if k > 1:
                term *= c * c * (2 * k - 2) / (2 * k - 1)
            total += term
        return (2 / math.pi) * (theta + s * total) if dof > 1 else 2 * theta / math.pi
    total, term = 1.0, 1.0
    for k in range(1, (dof - 2) // 2 + 1):  # terms c^2, c^4, ..., c^(dof-2)
        term *= c * c * (2 * k - 1) / (2 * k)
        total += term
    return s * total


def t_quantile(p: float, dof: int) -> float:
    """The p-quantile (p > 0.5) of Student's t with integer `dof`, by bisection on `t_two_sided_mass`."""
    if not 0.5 < p < 1.0:
        raise ValueError(f"p must be in (0.5, 1), got {p}")
    mass = 2 * p - 1  # P(|T| <= t_p)
    lo, hi = 0.0, 1.0
    while t_two_sided_mass(hi, dof) < mass:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if t_two_sided_mass(mid, dof) < mass:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return (lo + hi) / 2


def paired_ci(diffs: list[float], level: float = 0.95) -> dict:
    """Mean of `diffs`, its sample SD (n - 1), the t quantile and the two-sided `level` CI (module docstring)."""
    n = len(diffs)
    if n < 2:
        raise ValueError("a confidence interval needs at least 2 paired differences")
    mean = sum(diffs) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    t = t_quantile(0.5 + level / 2, n - 1)
    half = t * sd / math.sqrt(n)
    return {
        "n": n,
        "mean": mean,
        "sd": sd,
        "t": t,
        "half_width": half,
        "lower": mean - half,
        "upper": mean + half,
        "level": level,
    }


def window_mean(curve: list, first: int, last: int) -> float | None:
    """Mean of `curve` over 1-based steps first..last (a step with no reward is left out)."""
    vals = [x for x in curve[first - 1 : last] if x is not None]
    return sum(vals) / len(vals) if vals else None


# ---- the paired runs ----------------------------------------------------------------------------------------
def prepare_seed(wl: Workload, seed: int, a: argparse.Namespace, base: str, warm: str) -> dict:
    """Seed `seed`'s directory, prompt file and the context lichen_bench.rl's runners read."""
    d = os.path.join(base, f"seed{seed}")
    os.makedirs(d)  # `base` is this invocation's fresh run directory
    prompts = os.path.join(d, "prompts.jsonl")
    write_prompts(prompts, make_prompts(wl, a.steps, seed=seed))
    return {
        "dir": d,
        "checkpoint": warm,
        "prompts": prompts,
        "steps": a.steps,
        "seed": seed,
        "threads": a.threads,
        "timeout": a.timeout,
        "shape": model_shape(warm),
        "lichen_extra": list(a.lichen_arg or []),
        "matmul": None,
    }


def run_one(wl: Workload, fw: str, ctx: dict, a: argparse.Namespace) -> dict:
    """One framework's run for one seed: its reward curve and the early / late window means."""
    runner = runners.run_lichen if fw == "lichen" else runners.run_trl
    summary = runner(wl, ctx["dir"], "run", ctx)
    if "error" in summary:
        print(f"[learning] seed {ctx['seed']} {fw}: {summary['error']}", file=sys.stderr, flush=True)
        return {"error": summary["error"]}
    curve = summary.get("reward_curve") or []
    print(
        f"[learning] seed {ctx['seed']} {fw:<6}: reward "
        + " ".join(f"{x:.2f}" if x is not None else "-" for x in curve)
        + f"  ({summary.get('wall_s') or float('nan'):.1f}s)",
        flush=True,
    )
    return {
        "curve": curve,
        "early": window_mean(curve, 1, a.early_steps),
        "late": window_mean(curve, a.late_from, a.steps),
        "wall_s": summary.get("wall_s"),
        "step_time_s": summary.get("step_time_s"),
        "summary": summary,
    }


def run_all(wl: Workload, a: argparse.Namespace, base: str, warm: str) -> tuple[list[dict], dict]:
    """Every (seed, framework) run, `--jobs` at a time; which framework goes first alternates by seed."""
    ctxs = {s: prepare_seed(wl, s, a, base, warm) for s in range(1, a.seeds + 1)}
    tasks = [
        (s, fw)
        for s in ctxs
        for fw in (("lichen", "trl") if s % 2 else ("trl", "lichen"))
        if not (fw == "trl" and a.skip_trl)
    ]
    with ThreadPoolExecutor(max_workers=a.jobs) as pool:  # threads only wait on child processes
        futures = {task: pool.submit(run_one, wl, task[1], ctxs[task[0]], a) for task in tasks}
        done = {task: f.result() for task, f in futures.items()}
    seeds = [
        {"seed": s, "order": [fw for (t, fw) in tasks if t == s], **{fw: r for (t, fw), r in done.items() if t == s}}
        for s in ctxs
    ]
    trl_info = next((c["trl_info"] for c in ctxs.values() if c.get("trl_info")), {})
    return seeds, trl_info


def _ok(run: dict | None) -> bool:
    return bool(run) and "error" not in run and run.get("late") is not None and run.get("early") is not None


def analyse(seeds: list[dict], level: float = 0.95) -> dict:
    """Per-seed differences, the paired CI and both targets (see the module docstring)."""
    paired = [s for s in seeds if _ok(s.get("lichen")) and _ok(s.get("trl"))]
    diffs = [s["lichen"]["late"] - s["trl"]["late"] for s in paired]
    ci = paired_ci(diffs, level) if len(diffs) >= 2 else None
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    lich = [s["lichen"] for s in seeds if _ok(s.get("lichen"))]
    trl = [s["trl"] for s in seeds if _ok(s.get("trl"))]
    out = {
        "paired_seeds": [s["seed"] for s in paired],
        "diffs": diffs,
        "ci": ci,
        "lichen_early": mean([r["early"] for r in lich]),
        "lichen_late": mean([r["late"] for r in lich]),
        "trl_early": mean([r["early"] for r in trl]),
        "trl_late": mean([r["late"] for r in trl]),
    }
    out["target_ci"] = {
        "threshold": CI_LOWER_TARGET,
        "value": ci["lower"] if ci else None,
        "pass": bool(ci) and ci["lower"] >= CI_LOWER_TARGET,
    }
    out["target_improves"] = {
        "early": out["lichen_early"],
        "late": out["lichen_late"],
        "pass": out["lichen_late"] is not None and out["lichen_late"] > out["lichen_early"],
    }
    return out


# ---- printing -----------------------------------------------------------------------------------------------
def _f(x, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def format_table(seeds: list[dict], res: dict, early: int, late_from: int, steps: int) -> str:
    e, l = f"1-{early}" if early > 1 else "1", f"{late_from}-{steps}" if late_from < steps else str(steps)  # noqa: E741
    head = (
        f"{'seed':>4}  {'lichen ' + e:>12} {'lichen ' + l:>13}  {'TRL ' + e:>10} {'TRL ' + l:>10}  "
        f"{'lichen-TRL ' + l:>17}"
    )
    lines = [f"mean reward per seed (steps {e} and {l})", head, "-" * len(head)]
    for s in seeds:
        li, tr = s.get("lichen") or {}, s.get("trl") or {}
        diff = li["late"] - tr["late"] if _ok(li) and _ok(tr) else None
        lines.append(
            f"{s['seed']:>4}  {_f(li.get('early')):>12} {_f(li.get('late')):>13}  {_f(tr.get('early')):>10} "
            f"{_f(tr.get('late')):>10}  {_f(diff, '{:+.3f}'):>17}"
        )
    lines.append("-" * len(head))
    mean_diff = res["ci"]["mean"] if res["ci"] else None
    lines.append(
        f"{'mean':>4}  {_f(res['lichen_early']):>12} {_f(res['lichen_late']):>13}  "
        f"{_f(res['trl_early']):>10} {_f(res['trl_late']):>10}  {_f(mean_diff, '{:+.3f}'):>17}"
    )
    ci = res["ci"]
    if ci:
        lines.append(
            f"\nlichen - TRL, mean reward steps {l}: {ci['mean']:+.4f}, 95% CI [{ci['lower']:+.4f}, "
            f"{ci['upper']:+.4f}] (n={ci['n']} seeds, sd {ci['sd']:.4f}, t_0.975,{ci['n'] - 1} = "
            f"{ci['t']:.4f})"
        )
    else:
        lines.append(
            f"\nlichen - TRL: no 95% CI (needs both frameworks on at least 2 seeds; have {len(res['paired_seeds'])})"
        )
    tc, ti = res["target_ci"], res["target_improves"]
    lines.append(
        f"target 1, CI lower bound >= {tc['threshold']:+.2f}: {_f(tc['value'], '{:+.4f}')}  "
        f"{'PASS' if tc['pass'] else 'MISS'}"
    )
    lines.append(
        f"target 2, lichen mean reward steps {l} > steps {e}: {_f(ti['late'])} vs {_f(ti['early'])}  "
        f"{'PASS' if ti['pass'] else 'MISS'}"
    )
    return "\n".join(lines)


def ascii_plot(curves: dict[str, list], height: int = 10) -> str:
    """Reward (0..1, rows) against step (columns) for each framework's mean curve; first letter marks, * = both."""
    width = max((len(c) for c in curves.values()), default=0)
    if not width:
        return ""
    grid = [[" "] * width for _ in range(height + 1)]
    for name, curve in curves.items():
        mark = name[0].upper()
        for i, y in enumerate(curve):
            if y is None:
                continue
            row = height - round(min(max(y, 0.0), 1.0) * height)
            grid[row][i] = "*" if grid[row][i] not in (" ", mark) else mark
    lines = [f"{(height - r) / height:4.1f} |" + "  ".join(grid[r]) for r in range(height + 1)]
    lines.append("     +" + "-" * (3 * width - 2))
    lines.append("      " + "".join(f"{i + 1:<3}" for i in range(width)) + " step")
    keys = ", ".join(f"{n[0].upper()} = {n}" for n in curves)
    return f"mean reward over seeds by step ({keys}, * = both)\n" + "\n".join(lines)


def mean_curves(seeds: list[dict], steps: int) -> dict[str, list]:
    out = {}
    for fw in ("lichen", "trl"):
        runs = [s[fw]["curve"] for s in seeds if _ok(s.get(fw))]
        if runs:
            # per step, the mean over the seeds that have a reward there
            out[fw] = [window_mean([c[i] if i < len(c) else None for c in runs], 1, len(runs)) for i in range(steps)]
    return out


# ---- command line -------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lichen bench learning",
        description="SFT-warm-start the W1 model with lichen, then run lichen and TRL's GRPOTrainer from it on the "
        "same prompts for each seed; print per-seed mean rewards, the 95%% CI of lichen - TRL over the "
        "late steps and PASS/MISS for the learning targets (docs/performance.md). TRL comes from the `bench` extra.",
    )
    p.add_argument(
        "--workload",
        choices=["w1", "smoke"],
        default="w1",
        help="w1: the W1 addition task; smoke: a tiny model and batch to check the plumbing (default: w1)",
    )
    p.add_argument("--seeds", type=int, default=10, help="run seeds 1..N, at least 2 (default: 10)")
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the workload's, w1 20)")
    p.add_argument("--early-steps", type=int, default=2, help="the early window is steps 1..N (default: 2)")
    p.add_argument(
        "--late-from",
        type=int,
        default=None,
        help="the late window is steps N..--steps (default: the second half, 11 for 20 steps)",
    )
    add_sft_args(p)
    p.add_argument("--skip-trl", action="store_true", help="run lichen only (no CI, target 1 is a MISS)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of every child process (default: 2)")
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="framework runs at a time; rewards do not depend on it, wall time does (default: 1)",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before a child run is killed (default: 1800)")
    p.add_argument(
        "--work-dir",
        default=None,
        help="the random-init checkpoint is kept here; each invocation's SFT, prompts, logs and run "
        "outputs go to a new runs-NNN directory in it (default: a new temporary directory)",
    )
    p.add_argument("--out-json", default=None, help="write settings, every curve, the CI and the targets here")
    p.add_argument("--check", action="store_true", help="exit 1 when a target is missed (default: only on errors)")
    p.add_argument(
        "--lichen-arg",
        action="append",
        metavar="FLAG",
        help="extra `lichen train` flag for the RL runs; repeatable, e.g. --lichen-arg=--micro-batch-size "
        "--lichen-arg=8",
    )
    return p


def _validate(a: argparse.Namespace, wl: Workload) -> None:
    a.steps = a.steps if a.steps is not None else wl.steps
    if a.late_from is None:
        a.late_from = a.steps // 2 + 1
    checks = (
        ("--seeds", a.seeds, 2),
        ("--steps", a.steps, 1),
        ("--early-steps", a.early_steps, 1),
        ("--late-from", a.late_from, 1),
        ("--threads", a.threads, 1),
        ("--jobs", a.jobs, 1),
    )
    for flag, value, least in checks:
        if value < least:
            raise ConfigError(f"{flag} must be at least {least}, got {value}")
    for flag, value in (("--early-steps", a.early_steps), ("--late-from", a.late_from)):
        if value > a.steps:
            raise ConfigError(f"{flag} {value} is past the last step (--steps {a.steps}); lower it or raise --steps")
    check_sft_args(a)
    if not a.skip_trl and importlib.util.find_spec("trl") is None:
        raise ConfigError(
            "TRL is not installed: install the bench extra (pip install -e '.[bench]') or pass "
            "--skip-trl to run lichen alone"
        )


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    wl = WORKLOADS[a.workload]
    _validate(a, wl)
    work = a.work_dir or tempfile.mkdtemp(prefix="lichen-learning-")
    base = fresh_run_dir(work)
    machine = machine_info()
    cores = a.threads * a.jobs
    print(
        f"[learning] machine: {machine['cpu']}, {machine['usable_cpus']} usable CPUs, torch {machine['torch']}, "
        f"{a.threads} threads per run, {a.jobs} run(s) at a time; this invocation's runs go to {base}",
        flush=True,
    )
    machine["load_checks"] = [load_check("learning", "before", cores, machine["loadavg_start"])]
    try:
        sft = (
            {"checkpoint": a.warm_start, "heldout_accuracy": None}
            if a.warm_start
            else sft_warm_start(wl, a, base, os.path.join(work, f"{wl.name}-init"))
        )
    except RuntimeError as e:
        print(f"[learning] {e}", file=sys.stderr)
        return 1
    if not a.warm_start:
        print(
            f"[learning] warm start: {sft['checkpoint']}; greedy accuracy on {sft['heldout']} held-out sums "
            f"{_f(sft['heldout_accuracy'], '{:.1%}')} (SFT {sft['wall_s']:.0f}s wall, {sft['cpu_s']:.0f}s CPU)",
            flush=True,
        )
    print(
        f"[learning] {wl.name}: {a.seeds} seeds x (lichen, TRL) x {a.steps} steps of {wl.prompts_per_step} prompts "
        f"x {wl.group_size} samples, <= {wl.max_new_tokens} new tokens, lr {wl.lr}",
        flush=True,
    )
    seeds, trl_info = run_all(wl, a, base, sft["checkpoint"])
    res = analyse(seeds)
    curves = mean_curves(seeds, a.steps)
    print()
    if sft.get("heldout_accuracy") is not None:
        print(
            f"warm start (SFT {a.sft_steps} steps, lr {a.sft_lr}): greedy accuracy {sft['heldout_accuracy']:.1%} "
            f"on {sft['heldout']} held-out sums"
        )
    print(format_table(seeds, res, a.early_steps, a.late_from, a.steps))
    if curves:
        print()
        print(ascii_plot(curves))
    end = load_check("learning", "after", cores)
    machine["loadavg_end"] = end["loadavg"]
    machine["load_checks"].append(end)
    note = overloaded_summary(machine["load_checks"])
    if note:
        print(f"[learning] NOTE: {note}; the rewards do not depend on it, the wall times do")
    errors = [
        f"seed {s['seed']} {fw}: {s[fw]['error']}"
        for s in seeds
        for fw in ("lichen", "trl")
        if isinstance(s.get(fw), dict) and "error" in s[fw]
    ]
    if a.out_json:
        full = {
            "command": "lichen bench learning " + " ".join(argv),
            "machine": machine,
            "workload": wl.to_dict(),
            "settings": {k: v for k, v in vars(a).items() if k not in ("out_json",)},
            "sft": sft,
            "trl": trl_info,
            "seeds": seeds,
            "mean_curves": curves,
            "result": res,
            "errors": errors,
        }
        with open(a.out_json, "w", encoding="utf-8") as f:
            json.dump(full, f, indent=1, default=str)
        print(f"[learning] report written to {a.out_json}")
    if errors:
        return 1
    if a.check and not (res["target_ci"]["pass"] and res["target_improves"]["pass"]):
        return 1
    return 0
