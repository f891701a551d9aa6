"""Parts 2 and 3 of `lichen bench engines`: short `lichen train` runs over one launched `lichen serve` or vLLM
engine, per model and weight-sync transport, each in a fresh run directory.

Every run has the same flags but `--rollout-engine-backend`: W2's reward (the fraction of digits), --steps GRPO
steps of --train-prompts x --train-samples responses of up to --train-tokens tokens, lr 1e-6, one thread per
process (`--num-threads 1`; vLLM's OpenMP threads bound to the first of --train-cores, one thread as well), and
the whole run pinned to --train-cores (`taskset`: the trainer and its engine, with every process they start).
Transports: `nccl` (the gloo broadcast on CPU, lichen's default) and `disk` (full versions written by the trainer,
loaded by the engine). Read from each run's metrics.jsonl:

- `time/sync` of every step (the sync after the step's train phase), its mean and each value;
- `train/train_rollout_logprob_abs_diff` (per step: the mean |trainer - engine| log-prob of the rollout's tokens)
  and `train/train_rollout_logprob_abs_diff_max` (per step: the largest): their mean and max over the steps.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

from lichen_bench.children import run_child, tail
from lichen_bench.machine import REPO_ROOT, load_check

TRANSPORTS = ("nccl", "disk")
BACKENDS = ("lichen", "vllm")
REWARD = "lichen_bench.workloads.lichen_digit_fraction_reward"
DIFF = "train/train_rollout_logprob_abs_diff"


def train_argv(backend: str, transport: str, model: str, prompts: str, run: str, args: Any) -> list[str]:
    """The command of one run (see the module doc), pinned with taskset."""
    lichen = os.path.join(os.path.dirname(sys.executable), "lichen")
    argv = [shutil.which("taskset") or "taskset", "-c", args.train_cores, lichen, "train"]
    argv += ["--hf-checkpoint", model, "--prompt-data", prompts, "--custom-rm-path", REWARD, "--device", "cpu"]
    argv += ["--num-threads", "1", "--rollout-batch-size", str(args.train_prompts)]
    argv += ["--n-samples-per-prompt", str(args.train_samples), "--rollout-max-response-len", str(args.train_tokens)]
    argv += ["--num-rollout", str(args.steps), "--lr", "1e-6", "--output-dir", os.path.join(run, "out")]
    argv += ["--no-progress", "--rollout-num-engines", "1", "--rollout-engine-backend", backend]
    argv += ["--update-weight-transport", transport]
    if transport == "disk":
        argv += ["--update-weight-mode", "full", "--update-weight-disk-dir", os.path.join(run, "w")]
    if backend == "vllm":
        argv += args.vllm_train_flags
    return argv


def run_numbers(rows: list[dict]) -> dict:
    """What one run measured, from its metrics rows (see the module doc); None where a metric is missing."""
    syncs = [float(r["time/sync"]) for r in rows if r.get("time/sync") is not None]
    diffs = [float(r[DIFF]) for r in rows if r.get(DIFF) is not None]
    maxes = [float(r[f"{DIFF}_max"]) for r in rows if r.get(f"{DIFF}_max") is not None]
    return {
        "steps": len(rows),
        "sync_each_s": syncs,
        "sync_s": sum(syncs) / len(syncs) if syncs else None,
        "lp_diff_each": diffs,
        "lp_diff_mean": sum(diffs) / len(diffs) if diffs else None,
        "lp_diff_max": max(maxes) if maxes else None,
    }


def one_run(tag: str, argv: list[str], run: str, args: Any, loads: list) -> dict:
    """Run `lichen train` once in the fresh directory `run`; its numbers (run_numbers) and wall time."""
    from lichen.observe.metrics import read_metrics

    os.makedirs(run)
    cores = len(args.train_core_list)
    loads.append(load_check(tag, "before", cores))
    env = {
        "PYTHONPATH": os.path.join(REPO_ROOT, "benchmarks"),
        "VLLM_CPU_OMP_THREADS_BIND": str(args.train_core_list[0]),
    }
    child = run_child(argv, os.path.join(run, "train.log"), timeout=args.timeout, threads=1, extra_env=env)
    loads.append(load_check(tag, "after", cores))
    if child["rc"] != 0:
        print(f"[{tag}] FAILED (exit {child['rc']}); log {child['log']}:\n{tail(child['log'])}", flush=True)
        return {"tag": tag, "error": f"exit {child['rc']}", "log": child["log"], "log_tail": tail(child["log"])}
    out = run_numbers(read_metrics(os.path.join(run, "out")))
    out.update(tag=tag, wall_s=child["wall_s"], run_dir=run)
    print(
        f"[{tag}] {child['wall_s']:.0f} s; time/sync {out['sync_each_s']}; log-prob diff {out['lp_diff_each']}",
        flush=True,
    )
    return out
