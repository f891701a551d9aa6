"""Part 1 of `lichen bench engines`: `lichen serve` and vLLM on identical generation requests, each pinned.

One server at a time (never both: they would share the cores), each started by lichen's own launchers
(RemoteEngines.from_config, as `lichen train` starts them) and driven by lichen's own clients, so both pay the
same client. After the server is up, every thread of its process tree is pinned to the same core set
(os.sched_setaffinity per thread; threads and processes started later inherit it) and it runs as many compute
threads as the set has cores: `lichen serve --num-threads N`, vLLM's OpenMP threads bound by
VLLM_CPU_OMP_THREADS_BIND to the same cores (vLLM otherwise binds its own choice).

A pass sends every request at once (token ids in, temperature 1, per-request seed, ignore_eos + max_new_tokens:
every response has exactly that many tokens on both servers) and times each request from send to answer; useful
tok/s = response tokens / the pass's wall time. A short warm-up pass (not timed) runs first on each server.
Also the CPU seconds (user + system, /proc) the server's processes used during each pass, and response tokens per
CPU second: on a shared machine the wall time depends on the share of the pinned cores each server gets from the
scheduler (more runnable threads get more of it), the CPU time much less.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from contextlib import contextmanager
from typing import Any, Iterator

from lichen_bench.machine import load_check

VLLM_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def parse_cores(text: str) -> list[int]:
    """'0', '0-1' or '0,2' -> sorted core ids; ValueError naming --cores on anything else or a core not usable."""
    cores: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            cores.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"--cores {text!r}: expected core ids like 0, 0-1 or 0,2") from None
    usable = os.sched_getaffinity(0)
    if not cores or not cores <= usable:
        raise ValueError(f"--cores {text!r}: this process may use cores {sorted(usable)} only")
    return sorted(cores)


def process_tree(root: int) -> list[int]:
    """`root` and every process below it (read from /proc)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def pin_tree(root: int, cores: list[int]) -> dict:
    """Pin every thread of every process under `root` to `cores`; what was pinned, read back from the kernel."""
    pinned, seen = 0, set()
    for pid in process_tree(root):
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cores)
                seen.add(tuple(sorted(os.sched_getaffinity(tid))))
                pinned += 1
            except OSError:
                continue  # the thread ended meanwhile
    return {"threads_pinned": pinned, "affinities": sorted(seen)}


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """os.environ with `values` set (the launchers pass this process' environment to the servers), restored after."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def server_argv(backend: str, model: str, prompts: str, out: str, threads: int, vllm_flags: list[str]) -> list[str]:
    """The `lichen train` flags whose EngineConfig launches one server of `backend` on `model`."""
    argv = ["--hf-checkpoint", model, "--prompt-data", prompts, "--output-dir", out, "--rollout-num-engines", "1"]
    # what the parser requires of a run; the bench sends its own requests
    argv += ["--rollout-batch-size", "1", "--rm-type", "math", "--num-rollout", "1", "--n-samples-per-prompt", "2"]
    argv += ["--rollout-engine-backend", backend, "--num-threads", str(threads), "--no-progress"]
    return argv + (vllm_flags if backend == "vllm" else [])


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds (user + system) used so far by the processes under `root` (lichen_bench.sync's reader)."""
    from lichen_bench.sync import _cpu_seconds

    return sum(_cpu_seconds(pid) for pid in process_tree(root))


def summarize(latencies: list[float], walls: list[float], tokens: list[int], cpu: list[float]) -> dict:
    """Useful tok/s per pass and its median, per-request latency median and p90 over every request of every pass,
    and useful tokens per CPU second of the server's processes (median over passes)."""
    lat = sorted(latencies)
    p90 = lat[min(len(lat) - 1, int(round(0.9 * (len(lat) - 1))))]
    rates = [n / w for n, w in zip(tokens, walls)]
    return {
        "tok_s_each": rates,
        "tok_s": statistics.median(rates),
        "latency_median_s": statistics.median(lat),
        "latency_p90_s": p90,
        "wall_each_s": walls,
        "tokens_each": tokens,
        "cpu_each_s": cpu,
        "tok_per_cpu_s": statistics.median(n / c for n, c in zip(tokens, cpu)) if all(cpu) else None,
    }


def _per_cpu(r: dict) -> str:
    return "-" if r.get("tok_per_cpu_s") is None else f"{r['tok_per_cpu_s']:.1f}"


def _requests(prompt_ids: list[list[int]], samples: int, tokens: int) -> list[Any]:
    from lichen.engines.core.engine import GenRequest

    return [
        GenRequest(list(p), tokens, temperature=1.0, seed=1000 + i * samples + j, ignore_eos=True)
        for i, p in enumerate(prompt_ids)
        for j in range(samples)
    ]


def timed_pass(engines: Any, requests: list[Any]) -> tuple[list[float], float, int, list[int]]:
    """Send every request at once; (per-request seconds, the pass's wall seconds, response tokens, lengths)."""

    async def one(req: Any) -> tuple[float, int]:
        t0 = time.perf_counter()
        res = await engines.agenerate(req)
        return time.perf_counter() - t0, len(res.output_ids)

    async def all_of() -> list[tuple[float, int]]:
        return list(await asyncio.gather(*(one(r) for r in requests)))

    t0 = time.perf_counter()
    got = engines.run(all_of(), timeout=3600)
    wall = time.perf_counter() - t0
    lengths = [n for _, n in got]
    return [s for s, _ in got], wall, sum(lengths), lengths


def measure_server(
    backend: str, model: str, prompts_file: str, prompt_ids: list[list[int]], args: Any, run: str
) -> dict:
    """Start one `backend` server, pin it, warm it up, time --repeats passes; its numbers (see the module doc)."""
    from lichen.config import parse_train_args
    from lichen.config.engine_config import EngineConfig
    from lichen.engines.clients.remote_engines import RemoteEngines

    cores = args.core_list
    env = {VLLM_BIND_ENV: ",".join(map(str, cores)), "OMP_NUM_THREADS": str(len(cores))}
    flags = server_argv(backend, model, prompts_file, os.path.join(run, "out"), len(cores), args.vllm_flags)
    cfg = EngineConfig.from_args(parse_train_args(flags))
    t0 = time.perf_counter()
    with environment(env):
        engines = RemoteEngines.from_config(cfg)
    start_s = time.perf_counter() - t0
    try:
        pin = pin_tree(engines.launcher.servers[0].proc.pid, cores)
        print(f"[{backend}] up in {start_s:.0f} s; pinned {pin['threads_pinned']} threads to {pin['affinities']}")
        timed_pass(engines, _requests(prompt_ids[:2], 1, 8))  # warm-up, not timed
        reqs = _requests(prompt_ids, args.samples, args.tokens)
        loads = [load_check(f"gen {backend}", "before", len(cores))]
        lat, walls, toks, lengths, cpu = [], [], [], [], []
        server = engines.launcher.servers[0].proc.pid
        for _ in range(args.repeats):
            c0 = tree_cpu_seconds(server)
            s, w, n, lens = timed_pass(engines, reqs)
            cpu.append(tree_cpu_seconds(server) - c0)
            lat += s
            walls.append(w)
            toks.append(n)
            lengths += lens
        loads.append(load_check(f"gen {backend}", "after", len(cores)))
    finally:
        engines.close()
    out = summarize(lat, walls, toks, cpu)
    out.update(
        backend=backend,
        requests=len(reqs),
        forced_lengths=all(n == args.tokens for n in lengths),
        start_s=start_s,
        pinned=pin,
        loads=loads,
    )
    print(
        f"[{backend}] {out['tok_s']:.1f} tok/s (passes {', '.join(f'{r:.1f}' for r in out['tok_s_each'])}); "
        f"latency median {out['latency_median_s']:.2f} s, p90 {out['latency_p90_s']:.2f} s; "
        f"{_per_cpu(out)} tokens per CPU second of the server",
        flush=True,
    )
    return out
