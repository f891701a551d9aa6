"""`lichen bench rl`: lichen vs Hugging Face TRL's GRPOTrainer on the same CPU work, in the same run.

For each workload (lichen_bench.workloads): write the checkpoint and the prompt file once, measure the limits
(matmul throughput, HF `generate` and lichen's Engine on the step-1 batch), then run lichen and TRL back to
back `--repeats` times (alternating which goes first, so slow drifts of a shared machine hit both) and print
the medians and the ratio lichen / TRL of every metric.

Every framework run is its own child process (`python -m lichen_bench.run_lichen` / `run_trl`), so imports,
memory and thread pools do not leak between them; each child's peak RSS is the kernel's `ru_maxrss` for that
process, read with `os.wait4` when it exits.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from lichen_bench import report
from lichen_bench.workloads import (
    LICHEN_REWARD_PATHS,
    WORKLOADS,
    Workload,
    ensure_checkpoint,
    make_prompts,
    model_shape,
    write_prompts,
)
from lichen.errors import ConfigError

# lichen's side of the settings the benchmark fixes for both frameworks. --micro-batch-size is lichen's choice of
# how to run its trainer and may be overridden with --lichen-arg.
LICHEN_TRAINER_FLAGS = ("--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096")


def lichen_train_flags(wl: Workload, *, checkpoint: str, prompts: str, steps: int, seed: int, threads: int,
                       output_dir: str, extra: list[str]) -> list[str]:
    """`lichen train` flags equivalent to the TRL config in lichen_bench.run_trl.trl_config_kwargs."""
    return [
        "--hf-checkpoint", checkpoint, "--prompt-data", prompts, "--custom-rm-path", LICHEN_REWARD_PATHS[wl.reward],
        "--device", "cpu", "--num-threads", str(threads), "--seed", str(seed), "--output-dir", output_dir,
        "--rollout-batch-size", str(wl.prompts_per_step), "--n-samples-per-prompt", str(wl.group_size),
        "--rollout-max-response-len", str(wl.max_new_tokens), "--rollout-temperature", "1.0",
        "--rollout-top-p", "1.0", "--rollout-top-k", "-1", "--num-rollout", str(steps),
        "--num-steps-per-rollout", "1", "--advantage-estimator", "grpo", "--loss-agg-mode", "seq-mean-token-mean",
        "--eps-clip", "0.2", "--eps-clip-high", "0.2", "--lr", repr(wl.lr), "--lr-decay-style", "constant",
        "--lr-warmup-iters", "0", "--adam-beta1", "0.9", "--adam-beta2", "0.999", "--adam-eps", "1e-8",
        "--weight-decay", "0.0", "--clip-grad", "1.0", "--no-progress", *LICHEN_TRAINER_FLAGS, *extra,
    ]


def _child_env(threads: int, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update(extra or {})
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1",
               PYTHONUNBUFFERED="1")
    return env


def run_child(cmd: list[str], log_path: str, *, timeout: float, threads: int, extra_env: dict | None = None) -> dict:
    """Run `cmd`, logging to `log_path`; returns rc, wall seconds and this child's own peak RSS (KiB)."""
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_child_env(threads, extra_env))
        killed = False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if not killed and time.perf_counter() - t0 > timeout:
                proc.kill()
                killed = True
            time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"rc": proc.returncode, "timed_out": killed, "wall_s": time.perf_counter() - t0,
            "maxrss_kib": usage.ru_maxrss, "cpu_s": usage.ru_utime + usage.ru_stime, "log": log_path}


def _tail(path: str, n: int = 15) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def _load_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def run_lichen(wl: Workload, d: str, tag: str, ctx: dict, profile_path: str | None = None) -> dict:
    out_dir = os.path.join(d, f"lichen-{tag}")
    result = os.path.join(d, f"lichen-{tag}.json")
    flags = lichen_train_flags(wl, checkpoint=ctx["checkpoint"], prompts=ctx["prompts"], steps=ctx["steps"],
                               seed=ctx["seed"], threads=ctx["threads"], output_dir=out_dir, extra=ctx["lichen_extra"])
    child = run_child([sys.executable, "-m", "lichen_bench.run_lichen", result, "--", *flags],
                      os.path.join(d, f"lichen-{tag}.log"), timeout=ctx["timeout"], threads=ctx["threads"],
                      extra_env={"LICHEN_BENCH_PROFILE": profile_path} if profile_path else None)
    data = _load_json(result)
    if child["rc"] != 0 or data is None:
        return {"error": f"lichen run failed (rc {child['rc']}); log {child['log']}:\n{_tail(child['log'])}"}
    from lichen.observe.metrics import read_metrics

    steps = report.lichen_steps(data, read_metrics(out_dir))
    summary = report.summarize_run(steps, ctx["shape"], ctx["matmul"], child["maxrss_kib"], child["wall_s"])
    summary["cpu_s"] = child["cpu_s"]
    summary["torch_threads"] = data.get("torch_threads")
    summary["instrumentation_missing"] = data.get("instrumentation_missing", [])
    return summary


def run_trl(wl: Workload, d: str, tag: str, ctx: dict) -> dict:
    result = os.path.join(d, f"trl-{tag}.json")
    cmd = [sys.executable, "-m", "lichen_bench.run_trl", result, "--workload", wl.name,
           "--checkpoint", ctx["checkpoint"], "--prompts", ctx["prompts"], "--steps", str(ctx["steps"]),
           "--seed", str(ctx["seed"]), "--threads", str(ctx["threads"]), "--output-dir", os.path.join(d, f"trl-{tag}")]
    child = run_child(cmd, os.path.join(d, f"trl-{tag}.log"), timeout=ctx["timeout"], threads=ctx["threads"])
    data = _load_json(result)
    if child["rc"] != 0 or data is None:
        return {"error": f"TRL run failed (rc {child['rc']}); log {child['log']}:\n{_tail(child['log'])}"}
    summary = report.summarize_run(report.trl_steps(data), ctx["shape"], ctx["matmul"], child["maxrss_kib"],
                                   child["wall_s"])
    summary["cpu_s"] = child["cpu_s"]
    summary["torch_threads"] = data.get("torch_threads")
    summary["instrumentation_missing"] = data.get("instrumentation_missing", [])
    ctx["trl_info"] = {k: data.get(k) for k in ("versions", "config", "optim", "eos_token_ids")}
    return summary


def run_limits(wl: Workload, d: str, ctx: dict, *, repeats: int, skip_hf: bool, matmul_only: bool = False) -> dict:
    result = os.path.join(d, "matmul-end.json" if matmul_only else "limits.json")
    cmd = [sys.executable, "-m", "lichen_bench.run_gen", result, "--workload", wl.name, "--checkpoint",
           ctx["checkpoint"], "--prompts", ctx["prompts"], "--threads", str(ctx["threads"]), "--repeats",
           str(repeats), "--seed", str(ctx["seed"])] + (["--skip-hf"] if skip_hf else []) + \
        (["--matmul-only"] if matmul_only else [])
    child = run_child(cmd, result[:-5] + ".log", timeout=ctx["timeout"], threads=ctx["threads"])
    data = _load_json(result)
    if child["rc"] != 0 or data is None:
        return {"errors": [f"limits run failed (rc {child['rc']}); log {child['log']}:\n{_tail(child['log'])}"]}
    return data


def code_version() -> dict:
    """The lichen commit measured and how many files differ from it (read-only git queries; None outside git)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        status = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "changed_files": None}
    if commit.returncode != 0:
        return {"commit": None, "changed_files": None}
    return {"commit": commit.stdout.strip(), "changed_files": len(status.stdout.splitlines())}


def machine_info() -> dict:
    cpu = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        pass
    import torch

    return {
        "code": code_version(),
        "platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": platform.python_version(), "torch": torch.__version__,
        "loadavg_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def bench_workload(wl: Workload, a: argparse.Namespace, base: str) -> dict:
    d = os.path.join(base, wl.name)
    os.makedirs(d, exist_ok=True)
    steps = a.steps or wl.steps
    checkpoint = a.w1_checkpoint if (wl.name == "w1" and a.w1_checkpoint) else \
        ensure_checkpoint(wl, os.path.join(d, "checkpoint"))
    prompts = os.path.join(d, "prompts.jsonl")
    write_prompts(prompts, make_prompts(wl, steps))
    ctx = {"checkpoint": checkpoint, "prompts": prompts, "steps": steps, "seed": a.seed, "threads": a.threads,
           "timeout": a.timeout, "shape": model_shape(checkpoint), "lichen_extra": list(a.lichen_arg or []),
           "matmul": None}
    print(f"[bench] {wl.name}: {wl.samples_per_step} samples/step, <= {wl.max_new_tokens} new tokens, {steps} steps, "
          f"{a.repeats} repeat(s); work dir {d}", flush=True)
    limits = {}
    if not a.skip_limits:
        limits = run_limits(wl, d, ctx, repeats=a.gen_repeats, skip_hf=False)
        ctx["matmul"] = (limits.get("matmul") or {}).get("best_flops_per_s")
        print(report.format_limits(wl.name, limits, ctx["shape"]), flush=True)
    runs: dict[str, list[dict]] = {"lichen": [], "trl": []}
    errors: list[str] = []
    for rep in range(a.repeats):
        order = ["lichen", "trl"] if rep % 2 == 0 else ["trl", "lichen"]
        for fw in order:
            if fw == "trl" and a.skip_trl:
                continue
            summary = (run_lichen if fw == "lichen" else run_trl)(wl, d, f"r{rep}", ctx)
            if "error" in summary:
                errors.append(summary["error"])
                print(f"[bench] {wl.name} repeat {rep} {fw}: {summary['error']}", file=sys.stderr, flush=True)
                continue
            runs[fw].append(summary)
            print(f"[bench] {wl.name} repeat {rep} {fw}: step {summary.get('step_time_s', float('nan')):.3f}s "
                  f"(gen {summary.get('generate_s') or float('nan'):.3f}s, train {summary.get('train_s') or float('nan'):.3f}s), "
                  f"peak RSS {summary.get('peak_rss_mib', float('nan')):.0f} MiB", flush=True)
    profile = None
    if a.profile:
        profile = os.path.join(d, "lichen-profile.txt")
        prof_run = run_lichen(wl, d, "profile", ctx, profile_path=profile)
        if "error" in prof_run:
            errors.append(prof_run["error"])
            profile = None
        else:
            print(f"[bench] {wl.name}: cProfile of an extra (untimed) lichen run written to {profile}", flush=True)
    if not a.skip_limits and limits.get("matmul"):
        # once more after the runs: the best of both is the peak the fractions refer to
        end = run_limits(wl, d, ctx, repeats=1, skip_hf=True, matmul_only=True).get("matmul") or {}
        limits["matmul_end"] = end
        limits["peak_flops_per_s"] = max(limits["matmul"].get("best_flops_per_s") or 0,
                                         end.get("best_flops_per_s") or 0) or None
        for summary in runs["lichen"] + runs["trl"]:
            report.apply_peak(summary, limits["peak_flops_per_s"])
    med = {fw: report.medians(r) for fw, r in runs.items() if r}
    ratio = report.ratios(med["lichen"], med["trl"]) if "lichen" in med and "trl" in med else {}
    return {
        "workload": wl.to_dict(), "steps": steps, "checkpoint": checkpoint, "shape": ctx["shape"],
        "lichen_flags": lichen_train_flags(wl, checkpoint=checkpoint, prompts=prompts, steps=steps, seed=a.seed,
                                           threads=a.threads, output_dir="<run dir>", extra=ctx["lichen_extra"]),
        "trl": ctx.get("trl_info"), "limits": limits, "runs": runs, "median": med, "ratio": ratio,
        "errors": errors, "profile": profile,
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
    print(report.format_table(name, med["lichen"], med.get("trl"), res["ratio"]))
    for fw in ("lichen", "trl"):
        curve = med.get(fw, {}).get("reward_curve")
        if curve:
            print(f"reward curve {fw:<6} (median over repeats): " + " ".join(f"{x:.2f}" for x in curve))
    for fw in ("lichen", "trl"):
        miss = sorted({m for r in res["runs"].get(fw, []) for m in r.get("instrumentation_missing", [])})
        if miss:
            print(f"note: {fw} instrumentation could not wrap {', '.join(miss)}; the metrics built on it are missing")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lichen bench rl",
        description="Run lichen and Hugging Face TRL's GRPOTrainer back to back on identical CPU work and print "
                    "medians over repeats and the ratio lichen / TRL per metric. TRL comes from the optional "
                    "`bench` extra: pip install -e '.[bench]'.")
    p.add_argument("--workload", choices=["w1", "w2", "both", "smoke"], default="w1",
                   help="w1: 4.2M-parameter toy, 32 samples x 8 tokens; w2: 20M parameters, 64 samples x up to "
                        "256 tokens of ragged length; both; smoke: a seconds-long check of the harness itself "
                        "(default: w1)")
    p.add_argument("--repeats", type=int, default=3, help="runs per framework; medians are over them (default: 3)")
    p.add_argument("--steps", type=int, default=None, help="rollout steps per run (default: w1 20, w2 5)")
    p.add_argument("--skip-trl", action="store_true", help="run lichen only (no TRL needed)")
    p.add_argument("--skip-limits", action="store_true",
                   help="skip the matmul / HF generate / lichen engine measurements")
    p.add_argument("--gen-repeats", type=int, default=3, help="timed repeats of the generate baselines (default: 3)")
    p.add_argument("--out", default=None, help="write the full report (every run, medians, ratios) as JSON here")
    p.add_argument("--work-dir", default=None,
                   help="where checkpoints, prompts, logs and run outputs go (default: a new temporary directory)")
    p.add_argument("--seed", type=int, default=1234, help="seed of both frameworks (default: 1234)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of every child process (default: 2)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before a child run is killed (default: 3600)")
    p.add_argument("--w1-checkpoint", default=None,
                   help="use this HF checkpoint for W1 (e.g. an SFT warm start) instead of the random-init one")
    p.add_argument("--profile", action="store_true",
                   help="after the timed repeats, run lichen once more under cProfile and write the top functions "
                        "to <work dir>/<workload>/lichen-profile.txt")
    p.add_argument("--lichen-arg", action="append", metavar="FLAG",
                   help="extra `lichen train` flag appended to lichen's command line; repeatable, e.g. "
                        "--lichen-arg=--micro-batch-size --lichen-arg=8")
    return p


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    for flag, value in (("--repeats", a.repeats), ("--steps", a.steps or 1), ("--threads", a.threads),
                        ("--gen-repeats", a.gen_repeats)):
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    if a.w1_checkpoint and not os.path.isfile(os.path.join(a.w1_checkpoint, "config.json")):
        raise ConfigError(f"--w1-checkpoint {a.w1_checkpoint!r} has no config.json; pass an HF checkpoint directory")
    if not a.skip_trl and importlib.util.find_spec("trl") is None:
        raise ConfigError("TRL is not installed: install the bench extra (pip install -e '.[bench]') or pass "
                          "--skip-trl to run lichen alone")
    base = a.work_dir or tempfile.mkdtemp(prefix="lichen-bench-")
    os.makedirs(base, exist_ok=True)
    names = ["w1", "w2"] if a.workload == "both" else [a.workload]
    full = {"command": "lichen bench rl " + " ".join(argv), "machine": machine_info(), "workloads": {}}
    print(f"[bench] machine: {full['machine']['cpu']}, {full['machine']['usable_cpus']} usable CPUs, "
          f"torch {full['machine']['torch']}, {a.threads} threads per run; load average "
          f"{full['machine']['loadavg_start']}", flush=True)
    for name in names:
        full["workloads"][name] = res = bench_workload(WORKLOADS[name], a, base)
        print_workload(name, res)
    full["machine"]["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"\n[bench] load average at the end: {full['machine']['loadavg_end']} (other work on the machine makes "
          f"timings noisy; the JSON report keeps min/max over repeats for every metric)")
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(full, f, indent=1, default=str)
        print(f"[bench] report written to {a.out}")
    failed = [e for r in full["workloads"].values() for e in r["errors"]]
    return 1 if failed else 0
