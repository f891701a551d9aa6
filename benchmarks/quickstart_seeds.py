"""Does the quick start's RL gain hold across seeds? Runs examples/quickstart.py for each seed and checks it.

    .venv/bin/python benchmarks/quickstart_seeds.py [--seeds 1 2 3] [--workdir runs/quickstart_seeds]
                                                    [--min-gain 10] [--max-seconds 300]

Each seed runs in its own workdir (<workdir>/seed<N>) from nothing: model init, data split, SFT, GRPO. The
table shows held-out accuracy after SFT and after RL (500 held-out problems, greedy), the gain in points, the
wall time per stage and the CPU time of the whole run (user + system seconds; unlike wall time it does not grow
when other processes share the cores). A seed passes when RL gains at least --min-gain points and the run's
wall time is at most --max-seconds. Exit status 1 when any seed fails or a run crashes. Arguments after `--`
go to every quickstart run, e.g. `-- --rl-lr 2e-4`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from lichen_bench.children import split_passthrough

QUICKSTART = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "quickstart.py")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv, extra = split_passthrough(argv)
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--workdir", default="runs/quickstart_seeds")
    p.add_argument("--min-gain", type=float, default=10.0, help="points of held-out accuracy RL must add")
    p.add_argument("--max-seconds", type=float, default=300.0, help="wall-time limit of one quickstart run")
    p.add_argument("--verbose", action="store_true", help="stream each run's full output")
    return p.parse_args(argv), extra


def run_seed(seed: int, workdir: str, extra: list[str], verbose: bool) -> dict | None:
    """One quickstart run; its summary.json, or None when it failed."""
    cmd = [sys.executable, QUICKSTART, "--seed", str(seed), "--workdir", workdir, *extra]
    if not verbose:
        cmd.append("--quiet")
    print(f"--- seed {seed}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    rc = subprocess.call(cmd)
    wall = time.perf_counter() - t0
    summary_path = os.path.join(workdir, "summary.json")
    if rc != 0 or not os.path.isfile(summary_path):
        print(f"--- seed {seed}: quickstart failed (exit {rc}) after {wall:.0f}s", flush=True)
        return None
    with open(summary_path) as f:
        summary = json.load(f)
    summary["wall_with_startup"] = wall
    return summary


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    rows = []
    for seed in args.seeds:
        rows.append((seed, run_seed(seed, os.path.join(args.workdir, f"seed{seed}"), extra, args.verbose)))

    print(
        f"\nquick start over {len(rows)} seeds (pass: RL gain >= {args.min_gain:g} points and total wall time "
        f"<= {args.max_seconds:.0f}s)"
    )
    cols = ("seed", "SFT acc", "RL acc", "gain", "model", "SFT", "RL", "total", "CPU", "result")
    widths = (4, 7, 7, 6, 5, 5, 5, 6, 5)
    head = "  ".join(f"{c:>{w}}" for c, w in zip(cols, widths)) + "  " + cols[-1]
    print(head)
    print("-" * len(head))
    failed = 0
    for seed, s in rows:
        if s is None:
            print("  ".join(f"{c:>{w}}" for c, w in zip([str(seed)] + ["-"] * 8, widths)) + "  FAIL (crashed)")
            failed += 1
            continue
        t, c = s["seconds"], s.get("cpu_seconds", {})
        why = [] if s["delta_points"] >= args.min_gain else [f"gain < {args.min_gain:g}"]
        why += [] if t["total"] <= args.max_seconds else [f"time > {args.max_seconds:.0f}s"]
        failed += bool(why)
        cells = [
            str(seed),
            f"{100 * s['sft_accuracy']:.1f}%",
            f"{100 * s['rl_accuracy']:.1f}%",
            f"{s['delta_points']:+.1f}",
            f"{t['model']:.0f}s",
            f"{t['sft']:.0f}s",
            f"{t['rl']:.0f}s",
            f"{t['total']:.0f}s",
            f"{c['total']:.0f}s" if "total" in c else "-",
        ]
        print(
            "  ".join(f"{v:>{w}}" for v, w in zip(cells, widths))
            + "  "
            + ("ok" if not why else "FAIL (" + ", ".join(why) + ")")
        )
    ok = [s for _, s in rows if s is not None]
    if ok:
        mean = sum(s["delta_points"] for s in ok) / len(ok)
        print(f"mean gain {mean:+.1f} points over {len(ok)} completed seeds")
    print("PASS" if failed == 0 else f"FAIL: {failed} of {len(rows)} seeds")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
