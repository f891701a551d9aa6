"""`lichen bench sync --runtime ray`: weight sync of real `lichen train` runs, 2 Ray trainer ranks vs the local runtime.

    lichen bench sync --runtime ray [--sizes 2e7 2e8 4e8] [--transports nccl disk delta tensor] [--steps 2]
        [--bucket-mb 128] [--baseline-params 1e5] [--timeout 1800] [--work-dir DIR] [--json OUT]

For each model size (a llama of about that many parameters, random init, lichen_bench.sync.model_shape) and each
transport, two `lichen train` runs of --steps GRPO steps (1 prompt x 2 samples, 2 new tokens: the step is cheap,
the sync is the point), each in a fresh run directory, one thread per process (`--num-threads 1` for torch,
LICHEN_WEIGHT_THREADS=1 for the weight code's pools: each rank encodes its delta part on one core, so 2 ranks vs 1
compares equal per-rank resources even on a 2-core machine):

- `--runtime ray`: 2 trainer ranks (FSDP2 over gloo) + 1 `lichen serve` engine, each a Ray actor;
- `--runtime local`: the `lichen train` process trains, 1 launched `lichen serve` engine;

with the same transport: `nccl` (gloo on CPU), `disk` (full versions), `delta` (disk, xor deltas; a delta run
takes one more step, since its first version is full, and only delta versions are timed), `tensor` (`--colocate`,
shared-memory handles). `delta` also runs on Ray with 1 rank: the publish time 2 ranks vs 1.

Every number comes from the runs' own metrics.jsonl: `time/sync` (mean over the timed syncs), `time/sync_publish`,
the driver's `memory/<phase>_peak_rss_gb` (max over phases and steps), each rank's `memory/rank{r}/sync_peak_rss_gb`
and `memory/rank{r}/load_peak_rss_gb` (its peak from start through the model load). A rank's process costs memory
before it holds any weight (Python, torch, Ray's worker, gloo): one Ray run per transport on a model of
--baseline-params parameters measures that, and the bounds are that baseline plus 1.1 x

- during a sync: shard + optimizer shard + 2 buckets = model fp32 bytes / ranks x 3 (weights, AdamW's two moments)
  + 2 x --bucket-mb;
- at load: model fp32 bytes / ranks + the largest tensor's fp32 bytes.

The load average is printed before and after every run; the exit status is 0 unless a run failed (a report).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from lichen.weights.parallel import THREADS_ENV
from lichen_bench.children import run_child, tail
from lichen_bench.machine import fresh_run_dir, load_check
from lichen_bench.sync import model_shape

TRANSPORTS = ("nccl", "disk", "delta", "tensor")
SIZES = (2e7, 2e8, 4e8)  # the largest: docs/runtimes.md#measured-lichen-bench-sync---runtime-ray
RANKS = 2
MARGIN = 1.1
# A reward that differs between almost any two responses, so that GRPO's advantages are not all zero and every
# step changes the weights (a 0/1 reward on a random model is 0 everywhere: the zero-advantage skip leaves the
# weights as they were, and a delta version would carry no change).
REWARD_MODULE = "bench_sync_reward"
REWARD_SOURCE = """def varied(args, sample) -> float:
    return sum(map(ord, sample.response)) % 97 / 97
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="lichen bench sync --runtime ray",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--sizes", type=float, nargs="+", default=list(SIZES), help="model sizes in parameters")
    p.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=list(TRANSPORTS))
    p.add_argument("--steps", type=int, default=2, help="timed syncs per run (default 2)")
    p.add_argument("--bucket-mb", type=int, default=128, help="--update-weight-buffer-size in MiB (default 128)")
    p.add_argument(
        "--baseline-params", type=float, default=1e5, help="the model of the rank-baseline runs (default 1e5)"
    )
    p.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the rank-baseline runs (the memory bounds then print '-'; for an invocation that adds sizes)",
    )
    p.add_argument("--timeout", type=float, default=1800, help="seconds per lichen train run (default 1800)")
    p.add_argument("--work-dir", default="runs/bench_sync_ray", help="runs go under DIR/runs-NNN (default %(default)s)")
    p.add_argument("--json", default=None, help="write every run's numbers as JSON here")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    if args.bucket_mb < 1:
        p.error(f"--bucket-mb must be at least 1, got {args.bucket_mb}")
    if min(args.sizes) < 1e4 or args.baseline_params < 1e4:
        p.error("--sizes and --baseline-params must be at least 1e4 parameters")
    return args


def make_inputs(root: str, params: float) -> tuple[str, str, dict]:
    """A random-init llama of about `params` parameters and a prompt file; (model dir, prompts, its sizes)."""
    from lichen.models.tiny import make_tiny_model

    model = make_tiny_model(os.path.join(root, "model"), seed=0, init_std=0.02, **model_shape(params))
    numels = checkpoint_numels(model)
    prompts = os.path.join(root, "prompts.jsonl")
    with open(prompts, "w", encoding="utf-8") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"{i}+{i}=", "label": str(2 * i)}) + "\n")
    with open(os.path.join(root, f"{REWARD_MODULE}.py"), "w", encoding="utf-8") as f:
        f.write(REWARD_SOURCE)
    return model, prompts, {"params": sum(numels), "largest": max(numels)}


def checkpoint_numels(model: str) -> list[int]:
    """The element count of every tensor in a checkpoint's safetensors files (read from their headers)."""
    from safetensors import safe_open

    numels = []
    for name in sorted(os.listdir(model)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model, name), "pt") as f:
                for key in f.keys():
                    n = 1
                    for d in f.get_slice(key).get_shape():
                        n *= int(d)
                    numels.append(n)
    return numels


def train_argv(runtime: str, transport: str, ranks: int, model: str, prompts: str, run: str, args) -> list[str]:
    """The `lichen train` command line of one run (see the module doc)."""
    steps = args.steps + (1 if transport == "delta" else 0)
    argv = [
        os.path.join(os.path.dirname(sys.executable), "lichen"),
        "train",
        "--hf-checkpoint",
        model,
        "--prompt-data",
        prompts,
        "--custom-rm-path",
        f"{REWARD_MODULE}.varied",
        "--device",
        "cpu",
        "--num-threads",
        "1",
        "--rollout-batch-size",
        "1",
        "--n-samples-per-prompt",
        "2",
        "--rollout-max-response-len",
        "2",
        "--num-rollout",
        str(steps),
        "--update-weight-buffer-size",
        str(args.bucket_mb * 1024**2),
        "--output-dir",
        os.path.join(run, "out"),
        "--no-progress",
    ]
    if transport in ("disk", "delta"):
        argv += ["--update-weight-transport", "disk", "--update-weight-disk-dir", os.path.join(run, "w")]
        argv += ["--update-weight-mode", "full" if transport == "disk" else "delta"]
        if transport == "delta":
            argv += ["--update-weight-local-checkpoint-dir", os.path.join(run, "local")]
    else:
        argv += ["--update-weight-transport", transport]
    if transport == "tensor":
        argv.append("--colocate")
    if runtime == "ray":
        argv += ["--runtime", "ray", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", str(ranks)]
        argv += ["--rollout-num-gpus", "1"]
    else:
        argv += ["--rollout-num-engines", "1"]
    return argv


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def run_numbers(rows: list[dict], transport: str, ranks: int) -> dict:
    """What one run measured, from its metrics rows (one per step): the timed syncs' times, the driver's and each
    rank's peaks. Delta runs time only their delta versions (their first version is full)."""
    timed = [r for r in rows if r.get("time/sync") is not None]
    if transport == "delta":
        timed = [r for r in timed if r.get("sync/is_delta")]
    driver = [
        v for r in rows for k, v in r.items() if k.startswith("memory/") and k.count("/") == 1 and "peak_rss" in k
    ]

    def rank_max(r: int, phase: str) -> float | None:
        vals = [
            row[f"memory/rank{r}/{phase}_peak_rss_gb"] for row in rows if row.get(f"memory/rank{r}/{phase}_peak_rss_gb")
        ]
        return max(vals) if vals else None

    return {
        "sync_each_s": [float(r["time/sync"]) for r in timed],
        "sync_s": _mean([float(r["time/sync"]) for r in timed]),
        "publish_s": _mean([float(r["time/sync_publish"]) for r in timed if r.get("time/sync_publish") is not None]),
        "sync_bytes": _mean([float(r.get("sync/bytes") or 0) for r in timed]),
        "changed_density": _mean([float(r["sync/changed_density"]) for r in timed if "sync/changed_density" in r]),
        "driver_peak_gb": max(driver) if driver else None,
        "rank_sync_peak_gb": [rank_max(r, "sync") for r in range(ranks)],
        "rank_load_peak_gb": [rank_max(r, "load") for r in range(ranks)],
    }


def one_run(tag: str, argv: list[str], run: str, transport: str, ranks: int, args, loads: list) -> dict:
    """Run `lichen train` once in the fresh directory `run`; its numbers (run_numbers) and wall time."""
    from lichen.observe.metrics import read_metrics

    os.makedirs(run)
    loads.append(load_check(tag, "before", 2))
    reward_dir = os.path.dirname(run)  # make_inputs wrote the reward module beside the model
    env = {"PYTHONPATH": reward_dir, THREADS_ENV: "1"}  # the weight code on one thread per process, as torch
    child = run_child(argv, os.path.join(run, "train.log"), timeout=args.timeout, threads=1, extra_env=env)
    loads.append(load_check(tag, "after", 2))
    if child["rc"] != 0:
        return {"tag": tag, "error": f"exit {child['rc']}", "log": child["log"], "log_tail": tail(child["log"])}
    out = run_numbers(read_metrics(os.path.join(run, "out")), transport, ranks)
    out.update(tag=tag, wall_s=child["wall_s"], run_dir=run)
    print(f"[{tag}] {child['wall_s']:.0f} s; sync {out['sync_s']} s each {out['sync_each_s']}", flush=True)
    return out


def bounds(size: dict, bucket_bytes: int, ranks: int = RANKS) -> dict:
    """The issue's per-rank bounds, without the process baseline (see the module doc), in GB (1024^3 bytes)."""
    model = size["params"] * 4
    gb = 1024**3
    return {
        "sync_gb": MARGIN * (3 * model / ranks + 2 * bucket_bytes) / gb,
        "load_gb": MARGIN * (model / ranks + size["largest"] * 4) / gb,
    }


def measure(args) -> dict:
    """Every run of the invocation (see the module doc); {"sizes": [...], "baseline": {...}, "loads": [...]}."""
    root = fresh_run_dir(args.work_dir)
    print(f"runs under {root}", flush=True)
    loads: list = []
    out: dict = {"root": root, "sizes": [], "baseline": {}, "loads": loads, "baseline_size": None}
    base_dir = os.path.join(root, "baseline")
    if not args.no_baseline:
        model, prompts, out["baseline_size"] = make_inputs(base_dir, args.baseline_params)
    for t in [] if args.no_baseline else args.transports:
        argv = train_argv("ray", t, RANKS, model, prompts, os.path.join(base_dir, f"ray-{t}"), args)
        out["baseline"][t] = one_run(f"baseline {t}", argv, os.path.join(base_dir, f"ray-{t}"), t, RANKS, args, loads)
    for params in args.sizes:
        d = os.path.join(root, f"p{params:.0e}")
        t0 = time.perf_counter()
        model, prompts, size = make_inputs(d, params)
        print(
            f"model of {size['params'] / 1e6:.1f}M parameters written in {time.perf_counter() - t0:.0f} s", flush=True
        )
        entry: dict = {"requested": params, **size, "runs": {}}
        for t in args.transports:
            layouts = [("ray", RANKS), ("local", 1)] + ([("ray", 1)] if t == "delta" else [])
            for runtime, ranks in layouts:
                key = f"{runtime}{ranks}-{t}"
                run = os.path.join(d, key)
                argv = train_argv(runtime, t, ranks, model, prompts, run, args)
                entry["runs"][key] = one_run(f"{params:.0e} {key}", argv, run, t, ranks, args, loads)
                save_json(args, {**out, "sizes": [*out["sizes"], entry]})  # a long invocation keeps what it has
        out["sizes"].append(entry)
    return out


def save_json(args, res: dict) -> None:
    """Write the settings and `res` to --json (if given), replacing the file atomically."""
    if not args.json:
        return
    tmp = f"{args.json}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"settings": vars(args), **res}, f, indent=1)
    os.replace(tmp, args.json)


def _f(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def report(res: dict, args) -> list[str]:
    """Print the tables (see the module doc); returns the failed runs' lines."""
    failed = [
        f"{r['tag']}: {r['error']} ({r['log']})"
        for e in [{"runs": res["baseline"]}, *res["sizes"]]
        for r in e["runs"].values()
        if "error" in r
    ]
    bucket = args.bucket_mb * 1024**2
    print("\ntime/sync per sync (mean of the timed syncs), 2 Ray ranks + 1 engine vs the local runtime + 1 engine")
    print(f"{'params':>8} {'transport':<9} {'ray s':>8} {'local s':>8} {'ray/local':>9}")
    for e in res["sizes"]:
        for t in args.transports:
            ray, loc = e["runs"].get(f"ray2-{t}", {}), e["runs"].get(f"local1-{t}", {})
            print(
                f"{e['params'] / 1e6:>7.1f}M {t:<9} {_f(ray.get('sync_s')):>8} {_f(loc.get('sync_s')):>8} "
                f"{_ratio(ray.get('sync_s'), loc.get('sync_s')):>9}"
            )
    print("\ndriver (lichen train under --runtime ray) peak RSS, GB (max over phases and transports)")
    peaks = []
    for e in res["sizes"]:
        vals = [r["driver_peak_gb"] for k, r in e["runs"].items() if k.startswith("ray2-") and r.get("driver_peak_gb")]
        peaks.append(max(vals) if vals else None)
        print(f"{e['params'] / 1e6:>7.1f}M {_f(peaks[-1])}")
    if len(peaks) > 1 and peaks[0] is not None and peaks[-1] is not None:
        print(f"growth smallest -> largest: {(peaks[-1] - peaks[0]) * 1024:.0f} MB")
    print(
        f"\neach Ray rank's peak RSS, GB: during a sync vs baseline + 1.1 x (3 x model / {RANKS} + 2 buckets of "
        f"{args.bucket_mb} MiB); at load vs baseline + 1.1 x (model / {RANKS} + largest tensor); baseline = the same "
        f"rank's peak on the {(res['baseline_size'] or {}).get('params', 0) / 1e6:.2f}M-parameter model"
    )
    print(f"{'params':>8} {'transport':<9} {'rank':>4} {'sync':>7} {'bound':>7} {'':4} {'load':>7} {'bound':>7}")
    for e in res["sizes"]:
        b = bounds(e, bucket)
        for t in args.transports:
            r, base = e["runs"].get(f"ray2-{t}", {}), res["baseline"].get(t, {})
            for k in range(RANKS):
                s, ld = (
                    (r.get("rank_sync_peak_gb") or [None] * RANKS)[k],
                    (r.get("rank_load_peak_gb") or [None] * RANKS)[k],
                )
                bs, bl = (
                    (base.get("rank_sync_peak_gb") or [None] * RANKS)[k],
                    (base.get("rank_load_peak_gb") or [None] * RANKS)[k],
                )
                sb = bs + b["sync_gb"] if bs is not None else None
                lb = bl + b["load_gb"] if bl is not None else None
                ok = "-" if s is None or sb is None else "ok" if s <= sb else "OVER"
                okl = "-" if ld is None or lb is None else "ok" if ld <= lb else "OVER"
                print(
                    f"{e['params'] / 1e6:>7.1f}M {t:<9} {k:>4} {_f(s, '.2f'):>7} {_f(sb, '.2f'):>7} {ok:<4} "
                    f"{_f(ld, '.2f'):>7} {_f(lb, '.2f'):>7} {okl}"
                )
    if "delta" in args.transports:
        print("\ndisk delta publish (time/sync_publish, delta versions): 2 Ray ranks vs 1 Ray rank")
        for e in res["sizes"]:
            two, one = e["runs"].get("ray2-delta", {}), e["runs"].get("ray1-delta", {})
            print(
                f"{e['params'] / 1e6:>7.1f}M 2 ranks {_f(two.get('publish_s'))} s, 1 rank {_f(one.get('publish_s'))} s, "
                f"ratio {_ratio(two.get('publish_s'), one.get('publish_s'))}"
            )
    lo = [c["loadavg"][0] for c in res["loads"] if c.get("loadavg")]
    if lo:
        print(f"\n1-minute load average around the runs: {min(lo):.2f} - {max(lo):.2f} (2 cores)")
    for line in failed:
        print(f"FAILED {line}")
    return failed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    res = measure(args)
    failed = report(res, args)
    save_json(args, res)
    return 1 if failed else 0
