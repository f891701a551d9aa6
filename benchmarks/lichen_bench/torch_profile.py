"""`lichen bench profile`: where lichen's engine and trainer time goes on a workload, by torch.profiler.

Runs `lichen train` on the workload (the settings of `lichen bench rl`, equal work) for `--steps` steps in a child
process (lichen_bench.run_lichen with LICHEN_BENCH_TORCH_PROFILE set): the last step's `Engine.generate` and
`TrainActor.train` calls each run under torch.profiler (CPU activity), and their operator tables (self CPU time,
top `--rows`) are written to <run dir>/engine-ops.txt and train-ops.txt and printed. The first steps are
warm-up (thread pools, allocator growth). The profiler's own overhead inflates the many small ops, so read the
shares, not the seconds.
"""

from __future__ import annotations

import argparse
import os
import tempfile

from lichen.errors import ConfigError
from lichen_bench.children import tail
from lichen_bench.machine import fresh_run_dir, load_check
from lichen_bench.runners import run_lichen
from lichen_bench.workloads import WORKLOADS, ensure_checkpoint, make_prompts, model_shape, write_prompts

ENV = "LICHEN_BENCH_TORCH_PROFILE"


def install(prefix: str, steps: int, rows: int) -> None:
    """In the `lichen train` child: profile call number `steps` of Engine.generate and of TrainActor.train."""
    import functools

    from lichen.engines.core.engine import Engine
    from lichen.train.actor import TrainActor

    def wrap(cls, attr: str, name: str) -> None:
        original = getattr(cls, attr)
        calls = {"n": 0}

        @functools.wraps(original)
        def inner(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] != steps:
                return original(*args, **kwargs)
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                out = original(*args, **kwargs)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
            with open(f"{prefix}-{name}-ops.txt", "w", encoding="utf-8") as f:
                f.write(table)
            return out

        setattr(cls, attr, inner)

    wrap(Engine, "generate", "engine")
    wrap(TrainActor, "train", "train")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lichen bench profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="w2", help="the workload (default: w2)")
    p.add_argument("--steps", type=int, default=2, help="steps to run; the last one is profiled (default: 2)")
    p.add_argument("--rows", type=int, default=25, help="operators per table (default: 25)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    p.add_argument("--seed", type=int, default=1234, help="seed (default: 1234)")
    p.add_argument("--work-dir", default=None, help="checkpoint kept here; the run goes to a new runs-NNN in it")
    p.add_argument("--lichen-arg", action="append", metavar="FLAG", help="extra `lichen train` flag; repeatable")
    a = p.parse_args(argv)
    if a.steps < 1 or a.rows < 1 or a.threads < 1:
        raise ConfigError("--steps, --rows and --threads must be at least 1")
    wl = WORKLOADS[a.workload]
    work = a.work_dir or tempfile.mkdtemp(prefix="lichen-profile-")
    d = fresh_run_dir(work)
    load_check("profile", "before", a.threads)
    ckpt = ensure_checkpoint(wl, os.path.join(work, wl.name, "checkpoint"))
    prompts = os.path.join(d, "prompts.jsonl")
    write_prompts(prompts, make_prompts(wl, a.steps))
    ctx = {
        "checkpoint": ckpt,
        "prompts": prompts,
        "steps": a.steps,
        "seed": a.seed,
        "threads": a.threads,
        "timeout": 3600.0,
        "shape": model_shape(ckpt),
        "lichen_extra": list(a.lichen_arg or []),
        "matmul": None,
    }
    prefix = os.path.join(d, "profile")
    os.environ[ENV] = f"{prefix}:{a.steps}:{a.rows}"  # read by lichen_bench.run_lichen in the child
    try:
        summary = run_lichen(wl, d, "profiled", ctx, equal_work=True)
    finally:
        del os.environ[ENV]
    load_check("profile", "after", a.threads)
    if "error" in summary:
        print(summary["error"])
        return 1
    print(
        f"[profile] {wl.name}: step times "
        + " ".join(f"{x:.2f}s" for x in summary["step_times"])
        + f" (last step profiled); run in {d}"
    )
    for name in ("engine", "train"):
        path = f"{prefix}-{name}-ops.txt"
        print(f"\n{name} (step {a.steps}), top operators by self CPU time:\n{tail(path, a.rows + 10)}")
    return 0
