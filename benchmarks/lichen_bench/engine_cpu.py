"""CPU seconds of lichen's Engine on W2's step-1 batch, one thread, with the time in cache rebuilds split out.

    PYTHONPATH=benchmarks python -m lichen_bench.engine_cpu CHECKPOINT [--rows 32] [--repeats 2]

CHECKPOINT is W2's random-init checkpoint (`lichen bench profile --workload w2` leaves it at
<work dir>/w2/checkpoint). One natural pass draws the response lengths; each timed pass forces them (as the
limits child does). CPU seconds (`time.process_time`) rather than wall time: on a shared machine other processes
stretch wall time far more than the CPU time the engine itself spends, so before/after comparisons of one code
path stay readable under load.
"""

from __future__ import annotations

import argparse
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lichen_bench.engine_cpu")
    p.add_argument("checkpoint")
    p.add_argument("--rows", type=int, default=32, help="the first N rows of the 64-row batch (default: 32)")
    p.add_argument("--repeats", type=int, default=2, help="timed passes (default: 2)")
    p.add_argument("--seed", type=int, default=1234)
    a = p.parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    from lichen.engines.core import decode_batch
    from lichen.engines.core.engine import Engine
    from lichen_bench import run_gen
    from lichen_bench.workloads import WORKLOADS, make_prompts

    torch.set_num_threads(1)
    wl = WORKLOADS["w2"]
    prompts = run_gen._batch(make_prompts(wl, 1), wl)[: a.rows]
    tok = AutoTokenizer.from_pretrained(a.checkpoint)
    engine = Engine.from_pretrained(a.checkpoint, device="cpu")
    rebuild = {"cpu": 0.0, "n": 0}
    original = decode_batch.DecodeBatch._rebuild

    def timed(self, parts):
        c = time.process_time()
        try:
            return original(self, parts)
        finally:
            rebuild["cpu"] += time.process_time() - c
            rebuild["n"] += 1

    decode_batch.DecodeBatch._rebuild = timed
    lengths = [r for _, r in run_gen._lichen_generate(engine, tok, prompts, wl, a.seed)["lengths"]]
    print(f"{len(prompts)} rows, forced lengths: {sum(lengths)} tokens, longest {max(lengths)}")
    for rep in range(a.repeats):
        rebuild.update(cpu=0.0, n=0)
        c0, t0 = time.process_time(), time.perf_counter()
        run_gen._lichen_generate(engine, tok, prompts, wl, a.seed + rep, lengths)
        print(
            f"generate: {time.process_time() - c0:.2f} CPU-s ({time.perf_counter() - t0:.2f} s wall); "
            f"cache rebuilds {rebuild['cpu']:.3f} CPU-s in {rebuild['n']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
