"""One framework run (or limits measurement) of `lichen bench rl` / `learning`, each in its own child process.

Every framework run is its own child process (`python -m lichen_bench.run_lichen` / `run_trl`), so imports,
memory and thread pools do not leak between them; each child's peak RSS is the kernel's `ru_maxrss` for that
process, read with `os.wait4` when it exits (for lichen, the larger of it and the lifetime peak the run kept
itself: lichen's per-phase memory metrics reset the kernel's counter). `ctx` holds what every run of one workload
shares: checkpoint, prompt file, steps, seed, threads, timeout, model shape, extra lichen flags, matmul peak.
"""

from __future__ import annotations

import os
import sys

from lichen_bench import report
from lichen_bench.children import load_json, run_child, tail
from lichen_bench.workloads import LICHEN_REWARD_PATHS, Workload

# lichen's side of the settings the benchmark fixes for both frameworks. --micro-batch-size is lichen's choice of
# how to run its trainer and may be overridden with --lichen-arg.
LICHEN_TRAINER_FLAGS = ("--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096")
# Equal work: TRL runs the backward of every sample, so the compared lichen run does too. lichen's default skip
# of zero-advantage backwards is measured as its own variant.
EQUAL_WORK_FLAGS = ("--disable-zero-advantage-skip",)


def lichen_train_flags(
    wl: Workload,
    *,
    checkpoint: str,
    prompts: str,
    steps: int,
    seed: int,
    threads: int,
    output_dir: str,
    extra: list[str],
) -> list[str]:
    """`lichen train` flags equivalent to the TRL config in lichen_bench.run_trl.trl_config_kwargs."""
    return [
        "--hf-checkpoint",
        checkpoint,
        "--prompt-data",
        prompts,
        "--custom-rm-path",
        LICHEN_REWARD_PATHS[wl.reward],
        "--device",
        "cpu",
        "--num-threads",
        str(threads),
        "--seed",
        str(seed),
        "--output-dir",
        output_dir,
        "--rollout-batch-size",
        str(wl.prompts_per_step),
        "--n-samples-per-prompt",
        str(wl.group_size),
        "--rollout-max-response-len",
        str(wl.max_new_tokens),
        "--rollout-temperature",
        "1.0",
        "--rollout-top-p",
        "1.0",
        "--rollout-top-k",
        "-1",
        "--num-rollout",
        str(steps),
        "--num-steps-per-rollout",
        "1",
        "--advantage-estimator",
        "grpo",
        "--loss-agg-mode",
        "seq-mean-token-mean",
        "--eps-clip",
        "0.2",
        "--eps-clip-high",
        "0.2",
        "--lr",
        repr(wl.lr),
        "--lr-decay-style",
        "constant",
        "--lr-warmup-iters",
        "0",
        "--adam-beta1",
        "0.9",
        "--adam-beta2",
        "0.999",
        "--adam-eps",
        "1e-8",
        "--weight-decay",
        "0.0",
        "--clip-grad",
        "1.0",
        "--no-progress",
        *LICHEN_TRAINER_FLAGS,
        *extra,
    ]


def _fresh(path: str) -> str:
    """`path` for a run's output; one already there would mix another run's records into this one's report."""
    if os.path.exists(path):
        raise FileExistsError(f"{path} exists: each benchmark run writes to a new directory (machine.fresh_run_dir)")
    return path


def run_lichen(
    wl: Workload, d: str, tag: str, ctx: dict, profile_path: str | None = None, equal_work: bool = False
) -> dict:
    """One `lichen train` run; `equal_work` adds EQUAL_WORK_FLAGS (no zero-advantage backward is skipped)."""
    out_dir = _fresh(os.path.join(d, f"lichen-{tag}"))
    result = _fresh(os.path.join(d, f"lichen-{tag}.json"))
    extra = [*(EQUAL_WORK_FLAGS if equal_work else ()), *ctx["lichen_extra"]]
    flags = lichen_train_flags(
        wl,
        checkpoint=ctx["checkpoint"],
        prompts=ctx["prompts"],
        steps=ctx["steps"],
        seed=ctx["seed"],
        threads=ctx["threads"],
        output_dir=out_dir,
        extra=extra,
    )
    child = run_child(
        [sys.executable, "-m", "lichen_bench.run_lichen", result, "--", *flags],
        os.path.join(d, f"lichen-{tag}.log"),
        timeout=ctx["timeout"],
        threads=ctx["threads"],
        extra_env={"LICHEN_BENCH_PROFILE": profile_path} if profile_path else None,
    )
    data = load_json(result)
    if child["rc"] != 0 or data is None:
        return {"error": f"lichen run failed (rc {child['rc']}); log {child['log']}:\n{tail(child['log'])}"}
    from lichen.observe.metrics import read_metrics

    steps = report.lichen_steps(data, read_metrics(out_dir))
    if len(steps) != ctx["steps"]:
        return {
            "error": f"lichen run in {out_dir} logged {len(steps)} steps for {ctx['steps']} run; its metrics are "
            f"not this run's alone"
        }
    peak_kib = max(child["maxrss_kib"], data.get("lifetime_peak_rss_kib") or 0)
    summary = report.summarize_run(steps, ctx["shape"], ctx["matmul"], peak_kib, child["wall_s"])
    summary["cpu_s"] = child["cpu_s"]
    summary["torch_threads"] = data.get("torch_threads")
    summary["instrumentation_missing"] = data.get("instrumentation_missing", [])
    return summary


def run_trl(wl: Workload, d: str, tag: str, ctx: dict, grad_accum: int = 1, steps: int | None = None) -> dict:
    """One TRL GRPOTrainer run; `grad_accum` > 1 splits each step's batch into that many accumulated micro-batches."""
    result = _fresh(os.path.join(d, f"trl-{tag}.json"))
    steps = steps or ctx["steps"]
    cmd = [
        sys.executable,
        "-m",
        "lichen_bench.run_trl",
        result,
        "--workload",
        wl.name,
        "--checkpoint",
        ctx["checkpoint"],
        "--prompts",
        ctx["prompts"],
        "--steps",
        str(steps),
        "--seed",
        str(ctx["seed"]),
        "--threads",
        str(ctx["threads"]),
        "--grad-accum",
        str(grad_accum),
        "--output-dir",
        _fresh(os.path.join(d, f"trl-{tag}")),
    ]
    child = run_child(cmd, os.path.join(d, f"trl-{tag}.log"), timeout=ctx["timeout"], threads=ctx["threads"])
    data = load_json(result)
    if child["rc"] != 0 or data is None:
        return {"error": f"TRL run failed (rc {child['rc']}); log {child['log']}:\n{tail(child['log'])}"}
    summary = report.summarize_run(
        report.trl_steps(data), ctx["shape"], ctx["matmul"], child["maxrss_kib"], child["wall_s"]
    )
    summary["cpu_s"] = child["cpu_s"]
    summary["torch_threads"] = data.get("torch_threads")
    summary["instrumentation_missing"] = data.get("instrumentation_missing", [])
    summary["grad_accum"] = grad_accum
    ctx.setdefault("trl_info", {k: data.get(k) for k in ("versions", "config", "optim", "eos_token_ids")})
    return summary


def run_limits(wl: Workload, d: str, ctx: dict, *, repeats: int, skip_hf: bool, matmul_only: bool = False) -> dict:
    result = _fresh(os.path.join(d, "matmul-end.json" if matmul_only else "limits.json"))
    cmd = (
        [
            sys.executable,
            "-m",
            "lichen_bench.run_gen",
            result,
            "--workload",
            wl.name,
            "--checkpoint",
            ctx["checkpoint"],
            "--prompts",
            ctx["prompts"],
            "--threads",
            str(ctx["threads"]),
            "--repeats",
            str(repeats),
            "--seed",
            str(ctx["seed"]),
        ]
        + (["--skip-hf"] if skip_hf else [])
        + (["--matmul-only"] if matmul_only else [])
    )
    child = run_child(cmd, result[:-5] + ".log", timeout=ctx["timeout"], threads=ctx["threads"])
    data = load_json(result)
    if child["rc"] != 0 or data is None:
        return {"errors": [f"limits run failed (rc {child['rc']}); log {child['log']}:\n{tail(child['log'])}"]}
    return data
