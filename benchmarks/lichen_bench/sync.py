"""`lichen bench sync`: weight sync into a real `lichen serve` engine with every transport, on one model.

    lichen bench sync [--params 5e8] [--steps 3] [--lr 1e-6] [--batch 2] [--seq 32] [--dtype bfloat16]
        [--bandwidth 100e6] [--threads 2] [--transports full xor overwrite nccl tensor] [--work-dir DIR] [--json OUT]
    lichen bench sync --runtime ray [...]   real `lichen train` runs, 2 Ray ranks vs the local runtime, per model
        size and transport (lichen_bench.sync_ray; `lichen bench sync --runtime ray --help`)

1. Builds a llama of about --params parameters (random init from a config: hidden 1024 from 1e8 parameters up,
   else 512 or less for tiny sizes) and starts one `lichen serve` engine on it in --dtype (the engine dtype).
2. Trains --steps real AdamW steps at --lr (fp32 weights, next-token loss on a fixed random batch of --batch x
   --seq tokens: real gradients) and keeps the weights after each step in the engine dtype.
3. For each transport — full disk, delta xor, delta overwrite, nccl (gloo on CPU), tensor (shared-memory handles
   to /update_weights_from_tensor; CUDA IPC on GPU) — syncs the initial weights
   (version 1, not timed: for delta it is the full version that starts the chain), then the weights after each
   step (timed), through lichen.sync exactly as `lichen train` does (the trainer hands fp32 weights; each sync
   pays the cast to the engine dtype), and checks after every sync that the engine serves the trainer's weights
   bit for bit (lichen.sync.verify; not counted in the sync time).

Printed per transport (means over the timed syncs; bytes are engine-dtype bytes, GB = 1e9 bytes):
  changed   = bytes that differ from the previous version / model bytes (delta only);
  wire      = bytes written (disk), broadcast, or placed in shared memory (tensor: the request bodies carry only
              handles, `sync/request_bytes`), and that / full disk's;
  publish   = model bytes / trainer-side seconds (full: write the checkpoint; delta: diff + encode + compress +
              checksum + write);
  apply     = model bytes / engine-side seconds (full: reload; delta: /pull_weights into the local checkpoint +
              the live apply at /update_weights_from_disk, both reading, decompressing and verifying);
  sync      = end-to-end seconds of one sync (publish + pull + pause/flush/update/continue, or the broadcast),
              and full's / it;
  shared fs = projected seconds over a shared file system of --bandwidth bytes/s: publish + wire / bandwidth +
              apply (disk transports), and full's / it.
Then the seconds of each phase and the CPU seconds of both processes, and the end-to-end seconds of every timed
sync (the spread within the run). The targets of the weight-sync issue are checked at the end, PASS or MISS each (delta xor wire <= 5% of full,
publish and apply >= 1 GB/s, end-to-end >= 1.5x and shared fs >= 4x faster than full). The exit status is 0
even when a target is missed: it is a report. Timings are wall-clock on whatever else the machine runs; the load
average is printed before and after. Dirty pages are written back (os.sync, not timed) before every sync, so the
writeback of one sync's files does not run during the next one (in training, a train step lies between them).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import tempfile
import time

import torch

TRANSPORTS = ("full", "xor", "overwrite", "nccl", "tensor")
TARGETS = {"xor_wire": 0.05, "publish_Bps": 1e9, "apply_Bps": 1e9, "e2e_speedup": 1.5, "shared_fs_speedup": 4.0}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="lichen bench sync", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--params", type=float, default=5e8, help="model size in parameters (default 5e8)")
    p.add_argument("--steps", type=int, default=3, help="AdamW steps, each followed by a timed sync (default 3)")
    p.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (default 1e-6)")
    p.add_argument("--batch", type=int, default=2, help="sequences per training batch (default 2)")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence (default 32)")
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="engine dtype (default bfloat16)",
    )
    p.add_argument(
        "--bandwidth", type=float, default=100e6, help="shared file system bytes/s for the projection (default 100e6)"
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads for trainer and engine (default 2)")
    p.add_argument(
        "--transports",
        nargs="+",
        default=list(TRANSPORTS),
        choices=list(TRANSPORTS),
        help="what to run (default all four)",
    )
    p.add_argument(
        "--work-dir", default=None, help="model, versions and logs (default: a temporary directory, removed afterwards)"
    )
    p.add_argument("--json", default=None, help="write every measurement as JSON here")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.params < 1e4:
        p.error(f"--params must be at least 1e4, got {args.params:g}")
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    if args.bandwidth <= 0:
        p.error(f"--bandwidth must be positive, got {args.bandwidth:g}")
    return args


def model_shape(params: float) -> dict:
    """hidden h (1024 from 1e8 parameters, 512 from 1e7, else 128), MLP 2.75 h rounded to 64, h / 64 heads (at
    least 2), and the layers that reach `params` at 4 h^2 (attention) + 3 h m (MLP) parameters per layer."""
    h = 1024 if params >= 1e8 else 512 if params >= 1e7 else 128
    m = max(64, int(round(2.75 * h / 64)) * 64)
    per_layer = 4 * h * h + 3 * h * m
    return {
        "hidden_size": h,
        "intermediate_size": m,
        "num_heads": max(2, h // 64),
        "num_layers": max(1, int(round(params / per_layer))),
    }


def train_states(model_dir: str, args: argparse.Namespace, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    """The weights before and after each AdamW step, in the engine dtype (CPU copies)."""
    import torch.nn.functional as F

    from lichen.models import load_model

    model = load_model(model_dir, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, model.cfg.vocab_size, (args.batch, args.seq), generator=g)
    pos = torch.arange(args.seq).expand(args.batch, -1)

    def snapshot() -> dict[str, torch.Tensor]:
        return {n: p.detach().to(dtype).clone() for n, p in model.named_parameters()}  # noqa: F821 (deleted after use)

    states = [snapshot()]
    for k in range(args.steps):
        t0 = time.perf_counter()
        logits = model.logits(model(ids, pos))
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        states.append(snapshot())
        print(f"  step {k + 1}: loss {loss.item():.4f} ({time.perf_counter() - t0:.1f} s)", flush=True)
    del model, opt
    gc.collect()
    return states


def _transport(name: str, engines, work: str, model_dir: str):
    from lichen.sync.disk import FullDiskSync
    from lichen.sync.disk_delta import DeltaSync
    from lichen.sync.distributed import BroadcastSync

    root = os.path.join(work, name)
    shutil.rmtree(root, ignore_errors=True)
    if name == "full":
        return FullDiskSync(engines, disk_dir=os.path.join(root, "w"), hf_checkpoint=model_dir)
    if name == "nccl":
        return BroadcastSync(engines, buffer_size=512 * 1024**2, group_name=f"bench-{os.getpid()}")
    if name == "tensor":
        from lichen.sync.tensor_handles import TensorSync

        return TensorSync(engines, buffer_size=512 * 1024**2)
    return DeltaSync(
        engines,
        disk_dir=os.path.join(root, "w"),
        local_dir=os.path.join(root, "local"),
        hf_checkpoint=model_dir,
        encoding=name,
    )


def _cpu_seconds(pid: int | None) -> float:
    """CPU seconds (user + system) a process has used so far: this one for None, else from /proc (0 elsewhere)."""
    if pid is None:
        return time.process_time()
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def run_transport(
    name: str, engines, states, dtype: torch.dtype, work: str, model_dir: str, engine_pid: int | None = None
) -> list[dict]:
    """Sync every state in order (version 1, 2, ...); the metrics of every sync but the first. Besides wall
    times, the CPU seconds the trainer process and the engine process spent in each sync (`cpu/trainer`,
    `cpu/engine`): what the sync costs whatever else the machine runs."""
    from lichen.sync.verify import verify_engines

    t = _transport(name, engines, work, model_dir)
    rows = []
    try:
        for version, state in enumerate(states, start=1):
            trainer = {n: w.float() for n, w in state.items()}  # the trainer's fp32 view, made before the clock
            # Each sync starts with nothing left to write back: the kernel's writeback of the last sync's files
            # (1 GB for full; the engine's local checkpoint for delta) would otherwise run during this one. In a
            # training loop a train step lies between two syncs.
            os.sync()
            c0, e0 = _cpu_seconds(None), _cpu_seconds(engine_pid) if engine_pid else 0.0
            t0 = time.perf_counter()
            m = t.push(iter(trainer.items()), version, dtype)
            m["time/e2e"] = time.perf_counter() - t0
            m["cpu/trainer"] = _cpu_seconds(None) - c0
            m["cpu/engine"] = _cpu_seconds(engine_pid) - e0 if engine_pid else 0.0
            del trainer
            m.update(verify_engines(engines, lambda: iter(state.items()), dtype, version=version))
            if version > 1:
                rows.append(m)
    finally:
        if hasattr(t, "close"):
            t.close()
        shutil.rmtree(os.path.join(work, name), ignore_errors=True)
    return rows


def summarize(name: str, rows: list[dict], model_bytes: int, bandwidth: float) -> dict:
    """Means over the timed syncs of one transport (see the module doc for each field)."""

    def mean(key: str) -> float:
        return sum(float(r.get(key, 0.0) or 0.0) for r in rows) / len(rows)

    disk = name not in ("nccl", "tensor")
    publish = mean("time/sync_publish") if disk else 0.0
    pull = mean("time/sync_transfer") if name in ("xor", "overwrite") else 0.0
    apply = pull + mean("time/sync_apply") if disk else 0.0
    wire = mean("sync/bytes")
    return {
        "transport": name,
        "wire_bytes": wire,
        "publish_s": publish,
        "pull_s": pull,
        "apply_s": apply,
        "e2e_s": mean("time/e2e"),
        "e2e_each_s": [float(r["time/e2e"]) for r in rows],
        "verify_s": mean("time/sync_verify"),
        "request_bytes": mean("sync/request_bytes") if name == "tensor" else None,
        "cpu_trainer_s": mean("cpu/trainer"),
        "cpu_engine_s": mean("cpu/engine"),
        "changed_density": mean("sync/changed_density") if name in ("xor", "overwrite") else None,
        "publish_Bps": model_bytes / publish if publish else None,
        "apply_Bps": model_bytes / apply if apply else None,
        "shared_fs_s": publish + wire / bandwidth + apply if disk else None,
    }


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB"):
        if abs(n) < 1000:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"


def checks(results: list[dict]) -> list[tuple[str, bool]]:
    """(target, met) for each speed target (docs/performance.md) that the transports run allow to check."""
    full = next((r for r in results if r["transport"] == "full"), None)
    xor = next((r for r in results if r["transport"] == "xor"), None)
    if not (full and xor):
        return []
    return [
        (
            f"delta xor wire <= {TARGETS['xor_wire']:.0%} of full",
            xor["wire_bytes"] / full["wire_bytes"] <= TARGETS["xor_wire"],
        ),
        ("delta xor publish >= 1 GB/s", (xor["publish_Bps"] or 0) >= TARGETS["publish_Bps"]),
        ("delta xor apply >= 1 GB/s", (xor["apply_Bps"] or 0) >= TARGETS["apply_Bps"]),
        ("delta xor end-to-end >= 1.5x faster than full", full["e2e_s"] / xor["e2e_s"] >= TARGETS["e2e_speedup"]),
        (
            "delta xor over the shared fs >= 4x faster than full",
            full["shared_fs_s"] / xor["shared_fs_s"] >= TARGETS["shared_fs_speedup"],
        ),
    ]


def report(results: list[dict], model_bytes: int, args: argparse.Namespace) -> list[str]:
    """Print the table and the target checks; returns the missed targets."""
    full = next((r for r in results if r["transport"] == "full"), None)
    print(
        f"\nmodel: {model_bytes / 1e9:.3f} GB in {args.dtype}; {args.steps} AdamW step(s) at lr {args.lr:g}; "
        f"means over the timed syncs; shared fs at {args.bandwidth / 1e6:g} MB/s"
    )
    print(
        f"{'transport':<10} {'changed':>8} {'wire':>10} {'/full':>7} {'publish':>10} {'apply':>10} "
        f"{'sync s':>8} {'full/x':>7} {'shared-fs s':>12} {'full/x':>7}"
    )
    for r in results:
        ratio = f"{r['wire_bytes'] / full['wire_bytes']:.2%}" if full else "-"
        speed = f"{full['e2e_s'] / r['e2e_s']:.2f}x" if full else "-"
        shared = f"{r['shared_fs_s']:.2f}" if r["shared_fs_s"] is not None else "-"
        sfs = f"{full['shared_fs_s'] / r['shared_fs_s']:.2f}x" if full and r["shared_fs_s"] else "-"
        changed = f"{r['changed_density']:.2%}" if r["changed_density"] is not None else "-"
        pub = f"{r['publish_Bps'] / 1e9:.2f} GB/s" if r["publish_Bps"] else "-"
        app = f"{r['apply_Bps'] / 1e9:.2f} GB/s" if r["apply_Bps"] else "-"
        print(
            f"{r['transport']:<10} {changed:>8} {fmt_bytes(r['wire_bytes']):>10} {ratio:>7} {pub:>10} {app:>10} "
            f"{r['e2e_s']:>8.3f} {speed:>7} {shared:>12} {sfs:>7}"
        )
    print(
        "seconds per sync: publish / pull / pull + update / verify (not in the sync time) | CPU seconds of the "
        "trainer / engine process"
    )
    for r in results:
        print(
            f"  {r['transport']:<10} {r['publish_s']:.3f} / {r['pull_s']:.3f} / {r['apply_s']:.3f} / "
            f"{r['verify_s']:.3f} | {r['cpu_trainer_s']:.3f} / {r['cpu_engine_s']:.3f}"
        )
    for r in results:
        if r.get("request_bytes") is not None:
            print(
                f"  {r['transport']:<10} request bodies {fmt_bytes(r['request_bytes'])} per sync: handles, the "
                "weights stay in shared memory"
            )
    print("end-to-end seconds of each timed sync (the spread within one run):")
    for r in results:
        print(f"  {r['transport']:<10} " + " ".join(f"{x:.3f}" for x in r.get("e2e_each_s", [])))
    found = checks(results)
    for text, ok in found:
        print(f"  [{'PASS' if ok else 'MISS'}] {text}")
    return [t for t, ok in found if not ok]


def _engine_pid(launcher) -> int | None:
    try:
        return int(launcher.servers[0].proc.pid)
    except (AttributeError, IndexError, TypeError, ValueError):
        return None


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    runtime = argparse.ArgumentParser(add_help=False)
    runtime.add_argument("--runtime", choices=["process", "ray"], default="process")
    known, rest = runtime.parse_known_args(argv)
    if known.runtime == "ray":  # real `lichen train` runs, Ray ranks vs the local runtime (lichen_bench.sync_ray)
        from lichen_bench import sync_ray

        return sync_ray.main(rest)
    args = parse_args(rest)
    torch.set_num_threads(args.threads)
    from lichen.engines.clients.launcher import EngineLauncher
    from lichen.engines.clients.remote_engines import RemoteEngines
    from lichen.models.tiny import make_tiny_model

    dtype = getattr(torch, args.dtype)
    work = args.work_dir or tempfile.mkdtemp(prefix="lichen-bench-sync-")
    os.makedirs(work, exist_ok=True)
    shape = model_shape(args.params)
    print(f"load average at start: {_load()}", flush=True)
    t0 = time.perf_counter()
    model_dir = make_tiny_model(os.path.join(work, "model"), seed=args.seed, init_std=0.02, **shape)
    print(f"model {shape} written in {time.perf_counter() - t0:.1f} s; training {args.steps} step(s)", flush=True)
    states = train_states(model_dir, args, dtype)
    model_bytes = sum(t.numel() * t.element_size() for t in states[0].values())
    # every transport's versions and local copy are below `work`: the only dirs the engine may use for weights
    launcher = EngineLauncher(
        model_dir,
        1,
        server_args=[
            "--dtype",
            args.dtype,
            "--num-threads",
            str(args.threads),
            "--weight-dir",
            work,
            "--local-checkpoint-dir",
            work,
        ],
        log_dir=os.path.join(work, "logs"),
    )
    results, raw = [], {}
    try:
        engines = RemoteEngines(launcher.start(), launcher=launcher, concurrency=4, request_timeout=3600)
        try:
            for name in args.transports:
                print(f"syncing with {name} ...", flush=True)
                rows = run_transport(name, engines, states, dtype, work, model_dir, _engine_pid(launcher))
                raw[name] = rows
                results.append(summarize(name, rows, model_bytes, args.bandwidth))
        finally:
            engines.close()
    finally:
        launcher.stop()  # idempotent; also when the engines never came up
    missed = report(results, model_bytes, args)
    print(f"load average at end: {_load()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "settings": vars(args),
                    "shape": shape,
                    "model_bytes": model_bytes,
                    "summary": results,
                    "syncs": raw,
                    "missed_targets": missed,
                },
                f,
                indent=1,
            )
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0
