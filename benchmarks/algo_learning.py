"""Do other estimators learn on the quick-start task? Runs examples/quickstart.py (tiny model -> SFT -> RL on
two-digit addition, 500 held-out problems, greedy) with the RL stage switched to another algorithm, and prints
held-out accuracy before and after RL for each.

    .venv/bin/python benchmarks/algo_learning.py [--algos ppo grpo-dynamic-sampling] [--seed 4]

`ppo`: --advantage-estimator ppo (a critic on the same architecture, GAE, value clipping).
`grpo-dynamic-sampling`: GRPO with DAPO dynamic sampling (groups whose rewards all agree are dropped and more
prompts are drawn, 48 per round, until 32 groups with signal are kept).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import quickstart  # noqa: E402

ALGOS = {
    "grpo": [],
    "ppo": ["--advantage-estimator", "ppo", "--critic-lr", "1e-3"],
    "grpo-dynamic-sampling": [
        "--dynamic-sampling-filter-path",
        "lichen.rollout.filters.check_reward_nonzero_std",
        "--over-sampling-batch-size",
        "48",
    ],
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algos", nargs="+", choices=sorted(ALGOS), default=["ppo", "grpo-dynamic-sampling"])
    p.add_argument("--seed", type=int, default=4)
    p.add_argument("--workdir", default="runs/algo_learning")
    args = p.parse_args(argv)
    base_rl_argv = quickstart.rl_argv
    rows = []
    for algo in args.algos:
        quickstart.rl_argv = lambda a, paths, start, _x=ALGOS[algo]: base_rl_argv(a, paths, start) + _x
        workdir = os.path.join(args.workdir, f"{algo}_seed{args.seed}")
        print(f"--- {algo} (seed {args.seed})", flush=True)
        rc = quickstart.main(["--seed", str(args.seed), "--workdir", workdir, "--quiet"])
        if rc != 0:
            rows.append((algo, None, None))
            continue
        with open(os.path.join(workdir, "summary.json")) as f:
            s = json.load(f)
        rows.append((algo, s["sft_accuracy"], s["rl_accuracy"]))
    quickstart.rl_argv = base_rl_argv
    print(f"\nheld-out accuracy (500 problems, greedy), seed {args.seed}")
    print(f"{'algorithm':<24}{'after SFT':>10}{'after RL':>10}{'gain':>8}")
    for algo, before, after in rows:
        if before is None:
            print(f"{algo:<24}{'failed':>10}")
        else:
            print(f"{algo:<24}{100 * before:>9.1f}%{100 * after:>9.1f}%{100 * (after - before):>+8.1f}")
    return 0 if all(r[1] is not None and r[2] > r[1] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
