"""`lichen bench ckpt`: what `--save-interval 1` costs per step on W2, without saving, saving synchronously and
saving asynchronously (`--async-save`, the default), in one invocation.

Each variant is one `lichen train` child process on W2's random-init checkpoint and prompts (the flags of
`lichen bench rl`'s equal-work lichen run, lichen_bench.runners.lichen_train_flags), with a fresh output and save
directory of its own under `<work dir>/runs-NNN/`. Variants:
  none   no --save
  sync   --save DIR --save-interval 1 --no-async-save: every step writes its checkpoint before the step ends
  async  --save DIR --save-interval 1 --async-save: every step snapshots the state to CPU memory and a background
         thread writes the files (lichen.train.ckpt_async)
Per variant it reads the run's metrics.jsonl: `time/step` of every step but the first (warm-up: the first step
allocates Adam's state and the snapshot buffers) and `time/save` (the time the step spent in the save phase).
`--rounds` runs the variants that many times, rotating which goes first, to spread the machine's load over all.
It prints the medians and the ratios to `none`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from lichen_bench.children import run_child, tail
from lichen_bench.machine import fresh_run_dir, load_average
from lichen_bench.runners import EQUAL_WORK_FLAGS, lichen_train_flags
from lichen_bench.workloads import WORKLOADS, ensure_checkpoint, make_prompts, write_prompts

VARIANTS = ("none", "sync", "async")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="lichen bench ckpt", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workload", default="w2", choices=sorted(WORKLOADS), help="workload (default w2)")
    p.add_argument("--steps", type=int, default=6, help="rollout steps per run (default 6; the first is not timed)")
    p.add_argument("--rounds", type=int, default=1, help="runs per variant, rotating the order (default 1)")
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)} (default all)"
    )
    p.add_argument("--runtime", choices=("local", "ray"), default="local", help="--runtime of the runs (local)")
    p.add_argument("--ranks", type=int, default=2, help="trainer ranks with --runtime ray (default 2)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--seed", type=int, default=1234, help="--seed of the runs (default 1234)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run before it is killed (3600)")
    p.add_argument("--work-dir", default=None, help="where checkpoints and runs go (default: a temporary dir)")
    p.add_argument("--lichen-arg", action="append", default=[], help="append a `lichen train` flag (repeatable)")
    p.add_argument("--json", default=None, help="write every measurement as JSON here")
    return p.parse_args(argv)


def variant_flags(variant: str, save_dir: str) -> list[str]:
    """The `lichen train` flags that make `variant` (VARIANTS)."""
    if variant == "none":
        return []
    mode = "--async-save" if variant == "async" else "--no-async-save"
    return ["--save", save_dir, "--save-interval", "1", mode]


def runtime_flags(a: argparse.Namespace) -> list[str]:
    if a.runtime == "local":
        return []
    return ["--runtime", "ray", "--actor-num-gpus-per-node", str(a.ranks), "--rollout-num-gpus", "1"]


def run_variant(a: argparse.Namespace, variant: str, d: str, tag: str, ctx: dict) -> dict:
    """One `lichen train` run of `variant` in the fresh directory `d`/`tag`; its step and save times."""
    from lichen.observe.metrics import read_metrics

    out = os.path.join(d, tag)
    flags = lichen_train_flags(
        ctx["wl"],
        checkpoint=ctx["checkpoint"],
        prompts=ctx["prompts"],
        steps=a.steps,
        seed=a.seed,
        threads=a.threads,
        output_dir=os.path.join(out, "out"),
        extra=[*EQUAL_WORK_FLAGS, *runtime_flags(a), *variant_flags(variant, os.path.join(out, "ckpt")), *a.lichen_arg],
    )
    load_before = load_average()
    child = run_child(
        [sys.executable, "-m", "lichen.cli", "train", *flags],
        os.path.join(d, f"{tag}.log"),
        timeout=a.timeout,
        threads=a.threads,
    )
    if child["rc"] != 0:
        return {"variant": variant, "error": f"rc {child['rc']}, log {child['log']}:\n{tail(child['log'])}"}
    rows = [r for r in read_metrics(os.path.join(out, "out")) if "time/step" in r]
    timed = rows[1:] if len(rows) > 1 else rows
    return {
        "variant": variant,
        "step_s": [r["time/step"] for r in timed],
        "save_s": [r.get("time/save", 0.0) for r in timed],
        "wall_s": child["wall_s"],
        "load_before": load_before,
        "load_after": load_average(),
    }


def summarize(runs: list[dict], variants: list[str]) -> dict:
    """Median step and save time per variant (over every timed step of its runs) and the ratios to `none`."""
    out: dict = {}
    for v in variants:
        mine = [r for r in runs if r["variant"] == v and "error" not in r]
        steps = [s for r in mine for s in r["step_s"]]
        saves = [s for r in mine for s in r["save_s"]]
        if steps:
            out[v] = {"step_s": statistics.median(steps), "save_s": statistics.median(saves), "steps": len(steps)}
    base = out.get("none", {}).get("step_s")
    for row in out.values():
        row["ratio_to_none"] = row["step_s"] / base if base else None
    if "sync" in out and "async" in out:
        out["async_over_sync"] = out["async"]["step_s"] / out["sync"]["step_s"]
    return out


def print_summary(summary: dict, a: argparse.Namespace, runs: list[dict]) -> None:
    print(f"\n[bench ckpt] {a.workload}, --runtime {a.runtime}, --save-interval 1, {a.steps} steps (first untimed)")
    print(f"{'variant':<8} {'step s (median)':>16} {'save phase s':>13} {'x none':>8} {'steps':>6}")
    for v in VARIANTS:
        row = summary.get(v)
        if row:
            ratio = "-" if row["ratio_to_none"] is None else f"{row['ratio_to_none']:.3f}"
            print(f"{v:<8} {row['step_s']:>16.3f} {row['save_s']:>13.3f} {ratio:>8} {row['steps']:>6}")
    if "async_over_sync" in summary:
        print(f"async / sync step time: {summary['async_over_sync']:.3f}")
    loads = [r["load_before"] for r in runs if r.get("load_before")] + [
        r["load_after"] for r in runs if r.get("load_after")
    ]
    if loads:
        print(f"1-minute load average during the runs: {min(x[0] for x in loads):.1f}..{max(x[0] for x in loads):.1f}")
    for r in runs:
        if "error" in r:
            print(f"!! {r['variant']} failed: {r['error']}")


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        from lichen.errors import ConfigError

        raise ConfigError(f"--variants {a.variants!r}: choose from {', '.join(VARIANTS)}")
    work = a.work_dir or tempfile.mkdtemp(prefix="lichen-bench-ckpt-")
    wl = WORKLOADS[a.workload]
    d = fresh_run_dir(work)
    prompts = os.path.join(d, "prompts.jsonl")
    write_prompts(prompts, make_prompts(wl, a.steps))
    ctx = {"wl": wl, "checkpoint": ensure_checkpoint(wl, os.path.join(work, wl.name, "checkpoint")), "prompts": prompts}
    runs = []
    for rnd in range(a.rounds):
        order = variants[rnd % len(variants) :] + variants[: rnd % len(variants)]
        for v in order:
            r = run_variant(a, v, d, f"{v}-{rnd}", ctx)
            print(f"[bench ckpt] round {rnd} {v}: " + (r.get("error") or f"step s {r['step_s']}"), flush=True)
            runs.append(r)
    summary = summarize(runs, variants)
    print_summary(summary, a, runs)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"summary": summary, "runs": runs, "settings": vars(a)}, f, indent=1)
    return 1 if any("error" in r for r in runs) else 0
