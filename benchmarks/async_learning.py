"""Does `--async` learn as well as the synchronous loop? Paired seeds on the quick-start task (docs/async.md).

    .venv/bin/python benchmarks/async_learning.py [--seeds 10] [--workdir runs/async_learning] [--tiny]
                                                  [-- QUICKSTART ARGS]

For each seed s = 1..--seeds, in <workdir>/seed<s>: the quick start's model, data split and SFT warm-up
(examples/quickstart.py's own stages and flags), then its GRPO stage twice from that same SFT checkpoint: once
synchronously and once with --async, both over one launched `lichen serve` (--rollout-num-engines 1) so that the
only difference is the pipelining. The gain of a run is its last held-out accuracy minus the eval before training
(in points); the paired difference d_s = gain(async) - gain(sync). The report: each seed's gains and d_s, the mean
of d_s with its 95% confidence interval (Student t, n - 1 degrees of freedom; needs 2 seeds or more), and the
distribution of train/staleness_max over the async runs' steps with the mean of train/staleness_mean. The issue's
bar is a lower bound >= -3 points. Exit status 1 when a stage fails. Arguments after `--` go to the quick start
(e.g. `-- --rl-steps 100`); `--tiny` makes every stage a few steps (a smoke test, not a result).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # lichen_bench, when imported from a test

from lichen_bench.children import split_passthrough  # noqa: E402
from lichen_bench.learning import paired_ci  # noqa: E402

TINY = [
    "--max-operand",
    "9",
    "--heldout",
    "20",
    "--sft-steps",
    "2",
    "--sft-batch",
    "8",
    "--sft-eval-every",
    "2",
    "--rl-steps",
    "2",
    "--rl-prompts",
    "4",
    "--rl-group",
    "2",
    "--rl-eval-every",
    "2",
]
SERVER = ["--rollout-num-engines", "1"]


def load_quickstart():
    spec = importlib.util.spec_from_file_location("quickstart", os.path.join(HERE, "..", "examples", "quickstart.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["quickstart"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv, extra = split_passthrough(argv)
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--seeds", type=int, default=10, help="paired seeds 1..N")
    p.add_argument(
        "--first-seed",
        type=int,
        default=1,
        help="start at this seed (--seeds counts from it): split the seeds across invocations",
    )
    p.add_argument("--workdir", default="runs/async_learning")
    p.add_argument("--tiny", action="store_true", help="a few steps per stage: checks the script, measures nothing")
    return p.parse_args(argv), (TINY if "--tiny" in argv else []) + extra


def run_seed(qs, seed: int, workdir: str, qs_argv: list[str]) -> dict:
    """SFT once, then GRPO sync and --async from its checkpoint; gains in points and the async run's steps."""
    args = qs.parse_args(["--seed", str(seed), "--workdir", workdir, "--quiet", *qs_argv])
    paths = qs.Paths(os.path.abspath(workdir))
    paths.fresh()
    log = lambda name: os.path.join(paths.root, f"{name}.log")  # noqa: E731
    qs.run_stage(
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
            str(seed),
        ],
        log("model"),
        True,
        args.threads,
    )
    qs.make_data(args, paths)
    qs.run_stage("sft", qs.sft_argv(args, paths), log("sft"), True, args.threads)
    start = qs.sft_checkpoint(paths)
    out: dict = {"seed": seed}
    for mode, flags in (("sync", SERVER), ("async", SERVER + ["--async"])):
        argv = qs.rl_argv(args, paths, start)
        out_dir = os.path.join(paths.root, f"rl_{mode}")
        argv[argv.index("--output-dir") + 1] = out_dir
        qs.run_stage(f"rl_{mode}", argv + flags, log(f"rl_{mode}"), True, args.threads)
        curve = qs.eval_curve(os.path.join(out_dir, "metrics.jsonl"))
        if curve[0][0] != 0:
            raise qs.StageFailed(f"{out_dir}: no eval before training")
        out[f"{mode}_curve"] = curve
        out[f"{mode}_gain"] = 100 * (curve[-1][1] - curve[0][1])
        if mode == "async":
            with open(os.path.join(out_dir, "metrics.jsonl")) as f:
                rows = [json.loads(line) for line in f]
            out["staleness_max"] = [r["train/staleness_max"] for r in rows if "train/staleness_max" in r]
            out["staleness_mean"] = [r["train/staleness_mean"] for r in rows if "train/staleness_mean" in r]
    out["diff"] = out["async_gain"] - out["sync_gain"]
    return out


def report(rows: list[dict]) -> dict:
    print(f"\n{'seed':>4}  {'SFT acc':>7}  {'sync gain':>9}  {'async gain':>10}  {'async - sync':>12}")
    for r in rows:
        print(
            f"{r['seed']:>4}  {100 * r['sync_curve'][0][1]:>6.1f}%  {r['sync_gain']:>+9.1f}  "
            f"{r['async_gain']:>+10.1f}  {r['diff']:>+12.1f}"
        )
    diffs = [r["diff"] for r in rows]
    summary: dict = {"seeds": [r["seed"] for r in rows], "diffs": diffs}
    if len(diffs) >= 2:
        ci = paired_ci(diffs)
        summary["ci"] = ci
        print(
            f"mean async - sync: {ci['mean']:+.2f} points, 95% CI [{ci['lower']:+.2f}, {ci['upper']:+.2f}] "
            f"over {ci['n']} seeds (bar: lower bound >= -3: {'met' if ci['lower'] >= -3 else 'NOT met'})"
        )
    else:
        print(f"mean async - sync: {sum(diffs) / max(len(diffs), 1):+.2f} points (one seed: no confidence interval)")
    hist = collections.Counter(s for r in rows for s in r["staleness_max"])
    means = [s for r in rows for s in r["staleness_mean"]]
    summary["staleness_max_hist"] = {str(k): v for k, v in sorted(hist.items())}
    summary["staleness_mean"] = sum(means) / len(means) if means else None
    print(
        "async train/staleness_max per step:",
        dict(sorted(hist.items())),
        f"mean staleness {summary['staleness_mean']:.3f}" if means else "",
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    args, qs_argv = parse_args(argv)
    qs = load_quickstart()
    rows = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        print(f"--- seed {seed}", flush=True)
        try:
            rows.append(run_seed(qs, seed, os.path.join(args.workdir, f"seed{seed}"), qs_argv))
        except qs.StageFailed as e:
            print(f"async_learning: error: seed {seed}: {e}", file=sys.stderr)
            return 1
    summary = report(rows)
    summary["rows"] = rows
    with open(os.path.join(args.workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"details: {os.path.join(args.workdir, 'summary.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
