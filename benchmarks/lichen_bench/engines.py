"""`lichen bench engines`: lichen's own server (`lichen serve`) against vLLM, measured in one invocation.

    lichen bench engines [--quick] [--cores 0] [--gen-model w2] [--prompts 8] [--samples 8] [--tokens 256]
        [--repeats 2] [--train-cores 0-1] [--sizes w2 2e8] [--transports nccl disk] [--steps 3] [--train-prompts 4]
        [--train-samples 4] [--train-tokens 64] [--work-dir runs/bench_engines] [--json OUT]

A model is `w2` (W2's 20.5M-parameter llama: hidden 512, 6 layers, 8 heads of 64; lichen_bench.workloads) or a
parameter count (a random-init llama of about that size, lichen_bench.sync.model_shape). vLLM's CPU attention needs
a head size of 64 or more, which every one of these has.

1. Generation (lichen_bench.engines_gen): one server of each on --gen-model, pinned to --cores with as many
   threads, --prompts of W2's prompts x --samples each, --tokens forced new tokens (ignore_eos), temperature 1,
   the same seeds; useful tok/s (median over --repeats passes), per-request latency (median, p90 over all) and
   response tokens per CPU second of the server's processes (the measure that survives a shared machine).
2. Log-prob mismatch and 3. sync time (lichen_bench.engines_train): `lichen train` over one launched engine of
   each, per model of --sizes and transport of --transports; part 2 is the first size's runs: the rollout/trainer
   `train_rollout_logprob_abs_diff` (mean of the steps' means, max of the steps' maxima); part 3 the mean
   `time/sync`.

Ratios are lichen / vLLM of numbers measured in this invocation. vLLM runs from its own environment
(scripts/setup_vllm.sh, or $LICHEN_VLLM_PYTHON); without it the bench says so and measures lichen alone. Runs go
to a fresh `runs-NNN` directory of --work-dir; the JSON (--json, else <run dir>/engines.json) is rewritten after
every part. The exit status is 1 when a run failed, else 0 (a report).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from typing import Any

from lichen_bench.engines_gen import measure_server, parse_cores
from lichen_bench.engines_train import BACKENDS, TRANSPORTS, one_run, train_argv
from lichen_bench.machine import fresh_run_dir, machine_info
from lichen_bench.sync_ray import _f, _ratio, checkpoint_numels, save_json  # as --runtime ray's

QUICK = {  # seconds, not minutes: the plumbing of every part on a 2-layer model (the test's mode)
    "gen_model": "1e5",
    "prompts": 2,
    "samples": 2,
    "tokens": 16,
    "repeats": 1,
    "sizes": ["1e5"],
    "transports": ["nccl"],
    "steps": 2,
    "train_prompts": 2,
    "train_samples": 2,
    "train_tokens": 8,
}
VLLM_FLAGS = ["--vllm-max-model-len", "512"]
NO_COMPILE = ["--vllm-optimization-level", "0"]  # no torch.compile: starts a minute sooner, same kernels


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="lichen bench engines", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes for a test: " + json.dumps(QUICK))
    p.add_argument("--cores", default=None, help="core set of each server and run: 0, 0-1, 0,2 (default: first core)")
    p.add_argument("--train-cores", default=None, help="core set of each lichen train run (default: every usable core)")
    p.add_argument("--gen-model", default="w2", help="part 1's model: w2 or a parameter count (default w2)")
    p.add_argument("--prompts", type=int, default=8, help="part 1: prompts (default 8)")
    p.add_argument("--samples", type=int, default=8, help="part 1: samples per prompt (default 8)")
    p.add_argument("--tokens", type=int, default=256, help="part 1: forced new tokens per request (default 256)")
    p.add_argument("--repeats", type=int, default=2, help="part 1: timed passes per server (default 2)")
    p.add_argument("--sizes", nargs="+", default=["w2", "2e8"], help="parts 2-3: models (default w2 2e8)")
    p.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=list(TRANSPORTS))
    p.add_argument("--steps", type=int, default=3, help="parts 2-3: steps (= timed syncs) per run (default 3)")
    p.add_argument("--train-prompts", type=int, default=4, help="parts 2-3: prompts per step (default 4)")
    p.add_argument("--train-samples", type=int, default=4, help="parts 2-3: samples per prompt (default 4)")
    p.add_argument("--train-tokens", type=int, default=64, help="parts 2-3: max new tokens (default 64)")
    p.add_argument("--parts", nargs="+", default=["gen", "train"], choices=["gen", "train"], help="what to run")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per lichen train run (default 1800)")
    p.add_argument("--work-dir", default="runs/bench_engines", help="runs go under DIR/runs-NNN (default %(default)s)")
    p.add_argument("--json", default=None, help="write every number as JSON here (default <run dir>/engines.json)")
    p.add_argument(
        "--report", default=None, metavar="JSON", help="print the tables of an earlier run's JSON, run nothing"
    )
    args = p.parse_args(argv)
    if args.quick:
        given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in (argv or []) if a.startswith("--")}
        for k, v in QUICK.items():
            if k not in given:  # an explicit flag wins over --quick's value
                setattr(args, k, v)
    for name in ("prompts", "samples", "tokens", "repeats", "steps", "train_prompts", "train_samples", "train_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    try:
        args.core_list = parse_cores(args.cores or str(min(os.sched_getaffinity(0))))
        args.train_core_list = parse_cores(args.train_cores or ",".join(map(str, sorted(os.sched_getaffinity(0)))))
        for m in [args.gen_model, *args.sizes]:
            model_spec(m)
    except ValueError as e:
        p.error(str(e))
    args.cores = ",".join(map(str, args.core_list))
    args.train_cores = ",".join(map(str, args.train_core_list))
    args.vllm_flags = VLLM_FLAGS + (NO_COMPILE if args.quick else [])
    args.vllm_train_flags = VLLM_FLAGS + NO_COMPILE
    return args


def model_spec(text: str) -> float | None:
    """`w2` -> None (W2's checkpoint); a parameter count -> it; ValueError naming the flag otherwise."""
    if text.lower() == "w2":
        return None
    try:
        params = float(text)
    except ValueError:
        raise ValueError(f"model {text!r} (--gen-model / --sizes): expected w2 or a parameter count like 2e8") from None
    if params < 1e4:
        raise ValueError(f"model {text!r} (--gen-model / --sizes): at least 1e4 parameters")
    return params


def make_model(root: str, text: str) -> dict:
    """Write model `text` under `root` (once per invocation); {"name", "dir", "params"}."""
    from lichen.models.tiny import make_tiny_model
    from lichen_bench.sync import model_shape
    from lichen_bench.workloads import WORKLOADS, ensure_checkpoint

    params = model_spec(text)
    d = os.path.join(root, f"model-{text}")
    if not os.path.isdir(d):
        if params is None:
            ensure_checkpoint(WORKLOADS["w2"], d)
        else:
            make_tiny_model(d, seed=0, init_std=0.02, max_position_embeddings=512, **model_shape(params))
    n = sum(checkpoint_numels(d))
    return {"name": "W2" if params is None else text, "dir": d, "params": n}


def write_prompts(root: str, count: int) -> str:
    """W2's prompts (lichen_bench.workloads.make_prompts), at least `count` rows, as a JSONL file."""
    from lichen_bench.workloads import WORKLOADS, make_prompts
    from lichen_bench.workloads import write_prompts as write_rows

    wl = WORKLOADS["w2"]
    path = os.path.join(root, f"prompts-{count}.jsonl")
    write_rows(path, make_prompts(wl, -(-count // wl.prompts_per_step)))
    return path


def vllm_missing() -> str | None:
    """Why vLLM cannot run here (its environment's interpreter missing or not importing vllm), or None."""
    from lichen.engines.clients.vllm_launcher import resolve_python
    from lichen.errors import ConfigError

    try:
        python = resolve_python(None)
    except ConfigError as e:
        return str(e)
    probe = subprocess.run(
        [python, "-c", "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    return None if probe.returncode == 0 else f"{python} does not import vllm"


def part_gen(res: dict, args: argparse.Namespace, backends: list[str]) -> None:
    """Part 1 (lichen_bench.engines_gen) into res["gen"]."""
    from transformers import AutoTokenizer

    root = res["root"]
    model = make_model(root, args.gen_model)
    prompts = write_prompts(root, args.prompts)
    with open(prompts, encoding="utf-8") as f:
        texts = [json.loads(line)["prompt"] for line in f][: args.prompts]
    tok = AutoTokenizer.from_pretrained(model["dir"])
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    res["gen"] = {"model": model, "prompt_tokens": [len(i) for i in ids], "servers": {}}
    for b in backends:
        run = os.path.join(root, f"gen-{b}")
        os.makedirs(run)
        res["gen"]["servers"][b] = measure_server(b, model["dir"], prompts, ids, args, run)
        save_json(args, res)


def part_train(res: dict, args: argparse.Namespace, backends: list[str]) -> None:
    """Parts 2 and 3 (lichen_bench.engines_train) into res["train"]: one entry per model."""
    root = res["root"]
    prompts = write_prompts(root, args.steps * args.train_prompts)
    res["train"] = []
    for text in args.sizes:
        t0 = time.perf_counter()
        model = make_model(root, text)
        print(f"model {model['name']}: {model['params'] / 1e6:.1f}M parameters ({time.perf_counter() - t0:.0f} s)")
        entry: dict = {"model": model, "runs": {}}
        res["train"].append(entry)
        for t in args.transports:
            for b in backends:
                run = os.path.join(root, f"train-{text}-{t}-{b}")
                argv = train_argv(b, t, model["dir"], prompts, run, args)
                entry["runs"][f"{b}-{t}"] = one_run(f"{model['name']} {t} {b}", argv, run, args, res["loads"])
                save_json(args, res)


def later_mean(run: dict) -> float | None:
    """The mean time/sync of a run's syncs after its first (None with fewer than two)."""
    later = (run.get("sync_each_s") or [])[1:]
    return sum(later) / len(later) if later else None


def report(res: dict, args: argparse.Namespace) -> list[str]:
    """Print one table per part; returns the failed runs' lines."""
    if res.get("vllm_missing"):
        print(f"\nvLLM NOT MEASURED: {res['vllm_missing']} (lichen serve alone)")
    gen = res.get("gen")
    if gen:
        s = gen["servers"]
        print(
            f"\n1. generation: {len(gen['prompt_tokens'])} prompts x {args.samples} samples x {args.tokens} forced "
            f"tokens, temperature 1, model {gen['model']['name']} ({gen['model']['params'] / 1e6:.1f}M), each server "
            f"pinned to cores {args.cores} with {len(args.core_list)} thread(s); tok/s median of {args.repeats} pass(es)"
        )
        print(
            f"{'server':<8} {'tok/s':>9} {'lat med s':>10} {'lat p90 s':>10} {'tok/CPU-s':>10} {'forced':>7} "
            f"{'start s':>8}"
        )
        for b, r in s.items():
            print(
                f"{b:<8} {r['tok_s']:>9.1f} {r['latency_median_s']:>10.3f} {r['latency_p90_s']:>10.3f} "
                f"{_f(r.get('tok_per_cpu_s'), '.1f'):>10} {'yes' if r['forced_lengths'] else 'NO':>7} {r['start_s']:>8.0f}"
            )
        if "lichen" in s and "vllm" in s:
            lc, vl = s["lichen"], s["vllm"]
            print(
                f"{'lichen/vLLM':<8} {_ratio(lc['tok_s'], vl['tok_s']):>9} "
                f"{_ratio(lc['latency_median_s'], vl['latency_median_s']):>10} "
                f"{_ratio(lc['latency_p90_s'], vl['latency_p90_s']):>10} "
                f"{_ratio(lc.get('tok_per_cpu_s'), vl.get('tok_per_cpu_s')):>10}"
            )
    entries = res.get("train") or []
    failed = [f"{r['tag']}: {r['error']} ({r['log']})" for e in entries for r in e["runs"].values() if "error" in r]
    if entries:
        e = entries[0]
        print(
            f"\n2. rollout/trainer log-prob mismatch (train_rollout_logprob_abs_diff), model {e['model']['name']} "
            f"({e['model']['params'] / 1e6:.1f}M), {args.steps} steps of {args.train_prompts} x {args.train_samples} "
            f"x up to {args.train_tokens} tokens: mean of the steps' means, max of the steps' maxima"
        )
        print(f"{'transport':<9} {'server':<7} {'mean':>10} {'max':>10}")
        for t in args.transports:
            for b in BACKENDS:
                r = e["runs"].get(f"{b}-{t}", {})
                print(f"{t:<9} {b:<7} {_f(r.get('lp_diff_mean'), '.2e'):>10} {_f(r.get('lp_diff_max'), '.2e'):>10}")
            lc, vl = e["runs"].get(f"lichen-{t}", {}), e["runs"].get(f"vllm-{t}", {})
            print(
                f"{t:<9} {'l/vLLM':<7} {_ratio(lc.get('lp_diff_mean'), vl.get('lp_diff_mean')):>10} "
                f"{_ratio(lc.get('lp_diff_max'), vl.get('lp_diff_max')):>10}"
            )
        print(f"\n3. time/sync per sync (mean of {args.steps}), one engine, run pinned to cores {args.train_cores}")
        print("(and the mean of the syncs after the first: the gloo group forms in the first one)")
        print(
            f"{'model':<14} {'transport':<9} {'lichen s':>9} {'vLLM s':>9} {'lichen/vLLM':>11} {'2+ lichen':>10} "
            f"{'2+ vLLM':>9} {'lichen/vLLM':>11}"
        )
        for e in entries:
            label = f"{e['model']['name']} {e['model']['params'] / 1e6:.1f}M"
            for t in args.transports:
                lc, vl = e["runs"].get(f"lichen-{t}", {}), e["runs"].get(f"vllm-{t}", {})
                lc2, vl2 = later_mean(lc), later_mean(vl)
                print(
                    f"{label:<14} {t:<9} {_f(lc.get('sync_s')):>9} {_f(vl.get('sync_s')):>9} "
                    f"{_ratio(lc.get('sync_s'), vl.get('sync_s')):>11} {_f(lc2):>10} {_f(vl2):>9} "
                    f"{_ratio(lc2, vl2):>11}"
                )
    lo = [c["loadavg"][0] for c in res["loads"] if c.get("loadavg")]
    for r in (gen or {}).get("servers", {}).values():
        lo += [c["loadavg"][0] for c in r["loads"] if c.get("loadavg")]
    if lo:
        print(f"\n1-minute load average around the measurements: {min(lo):.2f} - {max(lo):.2f}")
    for line in failed:
        print(f"FAILED {line}")
    return failed


def reprint(path: str) -> int:
    """--report: the tables of the JSON an earlier invocation wrote, with its settings."""
    from lichen.errors import ConfigError
    from lichen_bench.children import load_json

    res = load_json(path)
    if not res or "settings" not in res:
        raise ConfigError(f"--report {path}: not a JSON file written by lichen bench engines")
    return 1 if report(res, argparse.Namespace(**res["settings"])) else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        return reprint(args.report)
    root = fresh_run_dir(args.work_dir)
    args.json = args.json or os.path.join(root, "engines.json")
    print(f"runs under {root}", flush=True)
    res: dict[str, Any] = {"root": root, "machine": machine_info(), "loads": [], "vllm_missing": vllm_missing()}
    backends = list(BACKENDS)
    if res["vllm_missing"]:
        print(f"vLLM's environment is missing: {res['vllm_missing']}; measuring lichen serve alone", flush=True)
        backends = ["lichen"]
    if "gen" in args.parts:
        part_gen(res, args, backends)
    if "train" in args.parts:
        part_train(res, args, backends)
    failed = report(res, args)
    save_json(args, res)
    print(f"JSON: {args.json}")
    return 1 if failed else 0
