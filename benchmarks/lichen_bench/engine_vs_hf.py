"""Useful tok/s of lichen's Engine against HF `generate` on W2's batch: same prompts, same forced per-row lengths,
one thread, CPU time of the calling thread (`time.thread_time`), the engines timed alternately.

    PYTHONPATH=benchmarks python -m lichen_bench.engine_vs_hf CHECKPOINT [--rows 64] [--rounds 3] [--old-tree DIR]

CHECKPOINT is W2's random-init checkpoint (`lichen bench profile --workload w2` leaves it at
<work dir>/w2/checkpoint). `--old-tree DIR` also times the Engine of another checkout (e.g. a `git worktree` of
the commit before a change) in the same process, so old and new code see the same load.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def _engine_from(root: str | None, checkpoint: str):
    """lichen's Engine imported from `root` (a checkout) or from the installed tree (None)."""
    for name in [m for m in sys.modules if m == "lichen" or m.startswith("lichen.")]:
        del sys.modules[name]
    if root:
        sys.path.insert(0, root)
    try:
        import lichen
        from lichen.engines.core.engine import Engine

        if root and not lichen.__file__.startswith(root):
            raise SystemExit(f"--old-tree {root}: lichen was imported from {lichen.__file__}, not from there")
        return Engine.from_pretrained(checkpoint, device="cpu")
    finally:
        if root:
            sys.path.remove(root)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lichen_bench.engine_vs_hf")
    p.add_argument("checkpoint")
    p.add_argument("--rows", type=int, default=64, help="the first N rows of the 64-row batch (default: 64)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds, each engine once per round (default: 3)")
    p.add_argument("--old-tree", default=None, help="also time the Engine of this checkout")
    p.add_argument("--seed", type=int, default=1234)
    a = p.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lichen_bench import run_gen
    from lichen_bench.workloads import WORKLOADS, make_prompts

    torch.set_num_threads(1)  # the benchmark's --threads 1
    tok, wl = AutoTokenizer.from_pretrained(a.checkpoint), WORKLOADS["w2"]
    prompts = run_gen._batch(make_prompts(wl, 1), wl)[: a.rows]  # step 1's prompts, group_size samples each
    engines = {"lichen": _engine_from(None, a.checkpoint)}
    if a.old_tree:
        engines["lichen (old tree)"] = _engine_from(a.old_tree, a.checkpoint)
    hf = AutoModelForCausalLM.from_pretrained(a.checkpoint, dtype=torch.float32).eval()
    lengths = [r for _, r in run_gen._lichen_generate(engines["lichen"], tok, prompts, wl, a.seed)["lengths"]]
    useful = sum(lengths)
    print(f"{len(prompts)} rows, forced lengths: {useful} tokens, longest {max(lengths)}")
    times: dict[str, list[float]] = {name: [] for name in [*engines, "HF generate"]}
    for r in range(a.rounds):
        for name in times:
            c = time.thread_time()
            if name == "HF generate":
                run_gen._hf_generate(hf, tok, prompts, wl, lengths, a.seed + r)
            else:
                run_gen._lichen_generate(engines[name], tok, prompts, wl, a.seed + r, lengths)
            times[name].append(time.thread_time() - c)
            print(f"round {r + 1} {name}: {times[name][-1]:.2f} CPU-s", flush=True)
    median = {name: statistics.median(t) for name, t in times.items()}
    for name, t in median.items():
        ratio = median["HF generate"] / t
        print(f"{name}: median {t:.2f} CPU-s, {useful / t:.1f} useful tok/s, {ratio:.2f}x HF generate")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
