"""`lichen bench rl`: lichen vs Hugging Face TRL's GRPOTrainer on the same CPU work, in the same run.

For each workload (lichen_bench.workloads): write the checkpoint and the prompt file, measure the limits
(matmul throughput, HF `generate` and lichen's Engine on the step-1 batch with forced identical lengths), then
run lichen and TRL back to back `--repeats` times (alternating which goes first, so slow drifts of a shared
machine hit both) and print the medians and the ratio lichen / TRL of every metric.

Equal work: W1 starts from an SFT warm start (lichen_bench.warm_start), so rewards are mixed, and the compared
lichen run passes --disable-zero-advantage-skip, so both frameworks run the forward and backward of every sample.
lichen's default (the skip on) runs as a separate variant on the workloads that have it, reported on its own.
Memory: TRL runs once more with gradient accumulation over one-sample micro-batches (the same math at its
lowest memory), and lichen's peak RSS is compared with that run's.

Each invocation writes its runs under a new `runs-NNN` directory of the work directory (lichen_bench.machine),
and reads the load average before and after each workload.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile

from lichen.errors import ConfigError
from lichen_bench import report
from lichen_bench.machine import fresh_run_dir, load_check, machine_info, overloaded_summary
from lichen_bench.runners import (  # noqa: F401  (lichen_train_flags: part of this suite's interface)
    EQUAL_WORK_FLAGS,
    lichen_train_flags,
    run_lichen,
    run_limits,
    run_trl,
)
from lichen_bench.warm_start import add_sft_args, check_sft_args, sft_warm_start
from lichen_bench.workloads import WORKLOADS, Workload, ensure_checkpoint, make_prompts, model_shape, write_prompts

FRAMEWORK_LABELS = {"lichen": "lichen (equal work)", "trl": "TRL", "lichen_skip": "lichen (zero-advantage skip)"}


def _checkpoint(wl: Workload, a: argparse.Namespace, work: str, d: str) -> tuple[str, dict | None]:
    """The workload's starting checkpoint: random init (kept in the work dir), or for W1 an SFT warm start."""
    init = ensure_checkpoint(wl, os.path.join(work, wl.name, "checkpoint"))
    if not wl.warm_start:
        return init, None
    if a.warm_start:
        return a.warm_start, None
    sft = sft_warm_start(wl, a, d, init)
    acc = sft["heldout_accuracy"]
    print(
        f"[bench] {wl.name}: warm start {sft['checkpoint']}, greedy accuracy on {sft['heldout']} held-out sums "
        f"{'-' if acc is None else f'{acc:.1%}'} (SFT {sft['wall_s']:.0f}s)",
        flush=True,
    )
    return sft["checkpoint"], sft


def _print_run(wl: Workload, rep: int, fw: str, summary: dict) -> None:
    nan = float("nan")
    skipped = summary.get("skipped_samples")
    print(
        f"[bench] {wl.name} repeat {rep} {FRAMEWORK_LABELS.get(fw, fw)}: step {summary.get('step_time_s', nan):.3f}s "
        f"(gen {summary.get('generate_s') or nan:.3f}s, train {summary.get('train_s') or nan:.3f}s), peak RSS "
        f"{summary.get('peak_rss_mib', nan):.0f} MiB"
        + (f", {skipped:.1f} of {wl.samples_per_step} backwards skipped/step" if skipped is not None else ""),
        flush=True,
    )


def bench_workload(wl: Workload, a: argparse.Namespace, work: str, runs_dir: str) -> dict:
    d = os.path.join(runs_dir, wl.name)
    os.makedirs(d)
    loads = [load_check("bench", f"before {wl.name}", a.threads)]
    steps = a.steps or wl.steps
    try:
        checkpoint, sft = _checkpoint(wl, a, work, d)
    except RuntimeError as e:
        return {"workload": wl.to_dict(), "errors": [str(e)], "runs": {}, "median": {}, "ratio": {}, "loads": loads}
    prompts = os.path.join(d, "prompts.jsonl")
    write_prompts(prompts, make_prompts(wl, steps))
    ctx = {
        "checkpoint": checkpoint,
        "prompts": prompts,
        "steps": steps,
        "seed": a.seed,
        "threads": a.threads,
        "timeout": a.timeout,
        "shape": model_shape(checkpoint),
        "lichen_extra": list(a.lichen_arg or []),
        "matmul": None,
    }
    print(
        f"[bench] {wl.name}: {wl.samples_per_step} samples/step, <= {wl.max_new_tokens} new tokens, {steps} steps, "
        f"{a.repeats} repeat(s); runs in {d}",
        flush=True,
    )
    limits = {}
    if not a.skip_limits:
        limits = run_limits(wl, d, ctx, repeats=a.gen_repeats, skip_hf=False)
        ctx["matmul"] = (limits.get("matmul") or {}).get("best_flops_per_s")
        print(report.format_limits(wl.name, limits, ctx["shape"]), flush=True)
    runs: dict[str, list[dict]] = {"lichen": [], "trl": [], "lichen_skip": []}
    errors: list[str] = []

    def record(fw: str, rep: int, summary: dict) -> None:
        if "error" in summary:
            errors.append(summary["error"])
            print(f"[bench] {wl.name} repeat {rep} {fw}: {summary['error']}", file=sys.stderr, flush=True)
        else:
            runs[fw].append(summary)
            _print_run(wl, rep, fw, summary)

    for rep in range(a.repeats):
        order = ["lichen", "trl"] if rep % 2 == 0 else ["trl", "lichen"]
        if wl.skip_variant and not a.no_skip_variant:
            order.append("lichen_skip")
        for fw in order:
            if fw == "trl" and a.skip_trl:
                continue
            if fw == "trl":
                record(fw, rep, run_trl(wl, d, f"r{rep}", ctx))
            else:
                record(fw, rep, run_lichen(wl, d, f"{fw}-r{rep}", ctx, equal_work=fw == "lichen"))
    memory = None
    if not a.skip_trl and not a.skip_memory:
        # TRL at its lowest memory for the same math: one-sample micro-batches, accumulated over the step
        mem = run_trl(wl, d, "grad-accum", ctx, grad_accum=wl.samples_per_step, steps=min(steps, 2))
        if "error" in mem:
            errors.append(mem["error"])
        else:
            memory = {"trl_grad_accum": wl.samples_per_step, "trl_peak_rss_mib": mem.get("peak_rss_mib"), "run": mem}
            print(
                f"[bench] {wl.name}: TRL with gradient accumulation ({wl.samples_per_step} x 1 sample), "
                f"{min(steps, 2)} steps: peak RSS {mem.get('peak_rss_mib', float('nan')):.0f} MiB",
                flush=True,
            )
    profile = None
    if a.profile:
        profile = os.path.join(d, "lichen-profile.txt")
        prof_run = run_lichen(wl, d, "profile", ctx, profile_path=profile, equal_work=True)
        if "error" in prof_run:
            errors.append(prof_run["error"])
            profile = None
        else:
            print(f"[bench] {wl.name}: cProfile of an extra (untimed) lichen run written to {profile}", flush=True)
    if not a.skip_limits and limits.get("matmul"):
        # once more after the runs: the best of both is the peak the fractions refer to
        end = run_limits(wl, d, ctx, repeats=1, skip_hf=True, matmul_only=True).get("matmul") or {}
        limits["matmul_end"] = end
        limits["peak_flops_per_s"] = (
            max(limits["matmul"].get("best_flops_per_s") or 0, end.get("best_flops_per_s") or 0) or None
        )
        for summary in runs["lichen"] + runs["trl"] + runs["lichen_skip"]:
            report.apply_peak(summary, limits["peak_flops_per_s"])
    med = {fw: report.medians(r) for fw, r in runs.items() if r}
    ratio = report.ratios(med["lichen"], med["trl"]) if "lichen" in med and "trl" in med else {}
    ratio_skip = report.ratios(med["lichen_skip"], med["trl"]) if "lichen_skip" in med and "trl" in med else {}
    if memory and med.get("lichen", {}).get("peak_rss_mib") and memory["trl_peak_rss_mib"]:
        memory["lichen_peak_rss_mib"] = med["lichen"]["peak_rss_mib"]
        memory["ratio"] = memory["lichen_peak_rss_mib"] / memory["trl_peak_rss_mib"]
    loads.append(load_check("bench", f"after {wl.name}", a.threads))
    return {
        "workload": wl.to_dict(),
        "steps": steps,
        "checkpoint": checkpoint,
        "sft": sft,
        "shape": ctx["shape"],
        "run_dir": d,
        "lichen_flags": lichen_train_flags(
            wl,
            checkpoint=checkpoint,
            prompts=prompts,
            steps=steps,
            seed=a.seed,
            threads=a.threads,
            output_dir="<run dir>",
            extra=[*EQUAL_WORK_FLAGS, *ctx["lichen_extra"]],
        ),
        "trl": ctx.get("trl_info"),
        "limits": limits,
        "runs": runs,
        "median": med,
        "ratio": ratio,
        "ratio_skip": ratio_skip,
        "memory": memory,
        "errors": errors,
        "profile": profile,
        "loads": loads,
    }


def print_workload(name: str, res: dict) -> None:
    med = res["median"]
    if res.get("limits"):
        print()
        print(report.format_limits(name, res["limits"], res["shape"]))
    if "lichen" not in med:
        print(f"\n{name}: no successful lichen run")
        return
    print()
    print(report.format_table(name + ", equal work", med["lichen"], med.get("trl"), res["ratio"]))
    if med.get("lichen_skip"):
        print()
        print(
            f"lichen's default, the zero-advantage skip on (not equal work: {res['workload']['name']} samples whose "
            f"group has equal rewards get no backward):"
        )
        print(
            report.format_table(
                name + ", skip on", med["lichen_skip"], med.get("trl"), res["ratio_skip"], keys=report.SKIP_VARIANT_KEYS
            )
        )
    mem = res.get("memory")
    if mem and mem.get("ratio") is not None:
        print(
            f"memory: lichen peak RSS {mem['lichen_peak_rss_mib']:.0f} MiB vs TRL with gradient accumulation "
            f"({mem['trl_grad_accum']} one-sample micro-batches) {mem['trl_peak_rss_mib']:.0f} MiB: "
            f"{mem['ratio']:.3f}"
        )
    for fw in ("lichen", "trl", "lichen_skip"):
        curve = med.get(fw, {}).get("reward_curve")
        if curve:
            print(
                f"reward curve {FRAMEWORK_LABELS[fw]:<29} (median over repeats): " + " ".join(f"{x:.2f}" for x in curve)
            )
    for fw in ("lichen", "trl", "lichen_skip"):
        miss = sorted({m for r in res["runs"].get(fw, []) for m in r.get("instrumentation_missing", [])})
        if miss:
            print(f"note: {fw} instrumentation could not wrap {', '.join(miss)}; the metrics built on it are missing")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lichen bench rl",
        description="Run lichen and Hugging Face TRL's GRPOTrainer back to back on identical CPU work and print "
        "medians over repeats and the ratio lichen / TRL per metric. TRL comes from the optional "
        "`bench` extra: pip install -e '.[bench]'.",
    )
    p.add_argument(
        "--workload",
        choices=["w1", "w2", "both", "smoke"],
        default="w1",
        help="w1: 4.2M-parameter toy from an SFT warm start (mixed rewards), 32 samples x 8 tokens; w2: "
        "20M parameters, 64 samples x up to 256 tokens of ragged length; both; smoke: a "
        "seconds-long check of the harness itself (default: w1)",
    )
    p.add_argument("--repeats", type=int, default=3, help="runs per framework; medians are over them (default: 3)")
    p.add_argument("--steps", type=int, default=None, help="rollout steps per run (default: w1 20, w2 8)")
    p.add_argument("--skip-trl", action="store_true", help="run lichen only (no TRL needed)")
    p.add_argument(
        "--skip-limits", action="store_true", help="skip the matmul / HF generate / lichen engine measurements"
    )
    p.add_argument(
        "--skip-memory",
        action="store_true",
        help="skip the extra TRL run with gradient accumulation that lichen's peak RSS is compared with",
    )
    p.add_argument(
        "--no-skip-variant",
        action="store_true",
        help="skip the extra lichen run per repeat with its zero-advantage skip on (W1)",
    )
    p.add_argument("--gen-repeats", type=int, default=3, help="timed repeats of the generate baselines (default: 3)")
    p.add_argument("--out", default=None, help="write the full report (every run, medians, ratios) as JSON here")
    p.add_argument(
        "--work-dir",
        default=None,
        help="random-init checkpoints are kept here; each invocation's prompts, logs and run outputs go "
        "to a new runs-NNN directory in it (default: a new temporary directory)",
    )
    p.add_argument("--seed", type=int, default=1234, help="seed of both frameworks (default: 1234)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of every child process (default: 2)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before a child run is killed (default: 3600)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="after the timed repeats, run lichen once more under cProfile and write the top functions "
        "to <run dir>/<workload>/lichen-profile.txt",
    )
    p.add_argument(
        "--lichen-arg",
        action="append",
        metavar="FLAG",
        help="extra `lichen train` flag appended to lichen's command line; repeatable, e.g. "
        "--lichen-arg=--micro-batch-size --lichen-arg=8",
    )
    add_sft_args(p, warm_start_flag="--w1-checkpoint")
    return p


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    for flag, value in (
        ("--repeats", a.repeats),
        ("--steps", a.steps or 1),
        ("--threads", a.threads),
        ("--gen-repeats", a.gen_repeats),
    ):
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    check_sft_args(a, "--w1-checkpoint")
    if not a.skip_trl and importlib.util.find_spec("trl") is None:
        raise ConfigError(
            "TRL is not installed: install the bench extra (pip install -e '.[bench]') or pass "
            "--skip-trl to run lichen alone"
        )
    work = a.work_dir or tempfile.mkdtemp(prefix="lichen-bench-")
    runs_dir = fresh_run_dir(work)
    names = ["w1", "w2"] if a.workload == "both" else [a.workload]
    full = {
        "command": "lichen bench rl " + " ".join(argv),
        "machine": machine_info(),
        "runs_dir": runs_dir,
        "workloads": {},
    }
    print(
        f"[bench] machine: {full['machine']['cpu']}, {full['machine']['usable_cpus']} usable CPUs, "
        f"torch {full['machine']['torch']}, {a.threads} threads per run; this invocation's runs go to {runs_dir}",
        flush=True,
    )
    for name in names:
        full["workloads"][name] = res = bench_workload(WORKLOADS[name], a, work, runs_dir)
        print_workload(name, res)
    full["machine"]["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    note = overloaded_summary([c for r in full["workloads"].values() for c in r.get("loads", [])])
    print(
        "\n[bench] "
        + (
            f"NOTE: {note}; read the ratios as indicative only"
            if note
            else f"load average stayed within the {a.threads} core(s) used at every check"
        )
    )
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(full, f, indent=1, default=str)
        print(f"[bench] report written to {a.out}")
    failed = [e for r in full["workloads"].values() for e in r["errors"]]
    return 1 if failed else 0
