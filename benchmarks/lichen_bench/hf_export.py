"""A multi-rank checkpoint's HF export (hf/, --save-hf) written by every rank vs by rank 0 alone, in one run.

Two gloo trainer ranks (torch.multiprocessing children, one thread each) hold a random llama of `--params`
parameters under FSDP2 and export it `--rounds` times per variant, the variants alternating:
  split  lichen's export (lichen.weights.rank_hf): each file written by one rank, each tensor gathered into it;
  rank0  the same files, bytes and exchanges with every file given to rank 0 (the plan for one rank): how the
         export was written before, the baseline.
For each it times the synchronous export (the slowest rank's wall time) and an --async-save checkpoint (the time on
the training path, which stages the rank's DCP shards and the tensors of its export files, and the time until the
write is done; a warm-up round of both comes first, untimed), with each rank's peak RSS growth over its resident set before the call. The export's files are
the single-process export's at a file size of `--file-mb` (the real default is 5 GiB, which keeps a model below
that one file and one writer: a 355B model's float32 export is 265 such files); the work is equal in both variants.

    PYTHONPATH=benchmarks python -m lichen_bench.hf_export [--params 2e8] [--file-mb 100] [--rounds 2]

docs/runtimes.md#checkpoints-written-by-every-rank has a run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

VARIANTS = ("split", "rank0")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rank(rank: int, world: int, a: argparse.Namespace, model: str, prompts: str, root: str, port: int) -> None:
    """One trainer rank: every measurement of every round, written to root/rank{rank}.json."""
    sys.path.insert(0, root)
    import torch
    import torch.distributed as dist

    import lichen.train.dist_trainer as dt
    from lichen.config import TrainerConfig, parse_train_args
    from lichen.observe.phases import peak_rss_bytes, reset_peaks
    from lichen.train import checkpoint
    from lichen.weights import hf_io
    from lichen.weights.rank_hf import layout_nbytes

    torch.set_num_threads(1)
    file_bytes = int(a.file_mb * 2**20)
    dt.plan_shards = lambda state: hf_io.plan_shards(state, file_bytes)
    split_plan = dt.plan_rank_hf
    argv = ["--hf-checkpoint", model, "--prompt-data", prompts, "--custom-rm-path", "bench_sync_reward.varied"]
    argv += ["--rollout-batch-size", "1", "--n-samples-per-prompt", "2", "--num-rollout", "1", "--device", "cpu"]
    argv += ["--num-threads", "1"]
    argv += ["--output-dir", os.path.join(root, "out"), "--no-progress"]
    args = parse_train_args(argv)
    t = dt.DistTrainer(
        TrainerConfig.from_args(args), args, rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port
    )
    rows = []

    for r in range(-1, a.rounds):  # round -1: a warm-up of both variants (the first save makes DCP's group)
        for variant in VARIANTS[r % 2 :] + VARIANTS[: r % 2]:
            dt.plan_rank_hf = split_plan if variant == "split" else (lambda s, lay, w: split_plan(s, lay, 1))
            out = os.path.join(root, f"{variant}-{r}")
            row: dict = {"variant": variant, "round": r}
            for kind in ("sync", "async"):
                dist.barrier()
                reset_peaks()
                before = _rss_bytes()
                t0 = time.perf_counter()
                if kind == "sync":
                    t._stream_hf(os.path.join(out, "hf"))
                    row["sync_s"] = time.perf_counter() - t0
                else:
                    if rank == 0:
                        checkpoint.begin_save(os.path.join(out, "ckpt"), 0)
                    assert t.save_async(os.path.join(out, "ckpt"), 0)
                    row["async_path_s"] = time.perf_counter() - t0
                    t.save_done()
                    row["async_done_s"] = time.perf_counter() - t0
                row[f"{kind}_growth_gb"] = (peak_rss_bytes() - before) / 1e9
            plan = t._hf_plan()[2]  # this variant's
            row["bytes"] = sum(layout_nbytes(*plan.layout[n]) for f in plan.files if f.rank == rank for n in f.tensors)
            row["files"] = len(plan.files)
            if r >= 0:
                rows.append(row)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(out)
    with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
        json.dump(rows, f)
    t.close()
    sys.stdout.flush()
    os._exit(0)  # as the tests' ranks end: the gloo group's threads outlive destroy_process_group under FSDP2


def report(ranks: list[list[dict]], a: argparse.Namespace) -> list[str]:
    """The table: per variant the median over rounds of the slowest rank's times and each rank's peak growth."""

    def med(xs: list[float]) -> float:
        xs = sorted(xs)
        return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2

    out = [
        f"{len(ranks)} ranks, {ranks[0][0]['files']} files of at most {a.file_mb:g} MB, medians of {a.rounds} "
        "round(s); times: the slowest rank's; growth: each rank's peak RSS over its resident set before the call",
        f"{'variant':<8}{'bytes per rank GB':>20}{'sync s':>9}{'sync growth GB':>20}{'async path s':>14}"
        f"{'async done s':>14}{'async growth GB':>20}",
    ]
    res: dict[str, dict] = {}
    for v in VARIANTS:
        per = [[row for row in rows if row["variant"] == v] for rows in ranks]
        rounds = range(len(per[0]))
        res[v] = {
            "sync": med([max(p[i]["sync_s"] for p in per) for i in rounds]),
            "path": med([max(p[i]["async_path_s"] for p in per) for i in rounds]),
            "done": med([max(p[i]["async_done_s"] for p in per) for i in rounds]),
            "growth": [med([p[i]["sync_growth_gb"] for i in rounds]) for p in per],
            "agrowth": [med([p[i]["async_growth_gb"] for i in rounds]) for p in per],
            "bytes": [p[0]["bytes"] / 1e9 for p in per],
        }
        r = res[v]
        out.append(
            f"{v:<8}{' / '.join(f'{b:.3f}' for b in r['bytes']):>20}{r['sync']:>9.3f}"
            f"{' / '.join(f'{g:.2f}' for g in r['growth']):>20}{r['path']:>14.3f}{r['done']:>14.3f}"
            f"{' / '.join(f'{g:.2f}' for g in r['agrowth']):>20}"
        )
    s, b = res["split"], res["rank0"]
    out.append(
        f"ratios, split / rank0: sync export {s['sync'] / b['sync']:.2f}x, async on the training path "
        f"{s['path'] / b['path']:.2f}x, async until done {s['done'] / b['done']:.2f}x; rank 0's async growth "
        f"{s['agrowth'][0] / max(b['agrowth'][0], 1e-9):.2f}x"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lichen_bench.hf_export", description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=2e8, help="model parameters (default 2e8: 0.8 GB fp32)")
    p.add_argument("--file-mb", type=float, default=100.0, help="export file size in MB (default 100)")
    p.add_argument("--rounds", type=int, default=2, help="exports per variant, alternating (default 2)")
    p.add_argument("--ranks", type=int, default=2, help="trainer ranks (default 2)")
    p.add_argument("--work-dir", default=None, help="where the model and exports go (default: a temporary dir)")
    a = p.parse_args(argv)
    if a.rounds < 1 or a.ranks < 2 or a.file_mb <= 0 or a.params <= 0:
        p.error("--rounds must be at least 1, --ranks at least 2, --file-mb and --params positive")
    import torch.multiprocessing as mp

    from lichen_bench.sync_ray import make_inputs

    root = tempfile.mkdtemp(prefix="lichen-bench-hf-", dir=a.work_dir)
    try:
        model, prompts, size = make_inputs(root, a.params)
        print(f"model: {size['params'] / 1e6:.1f}M parameters ({size['params'] * 4 / 1e9:.2f} GB fp32)", flush=True)
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_rank, args=(a.ranks, a, model, prompts, root, port), nprocs=a.ranks, join=True)
        ranks = [json.load(open(os.path.join(root, f"rank{r}.json"))) for r in range(a.ranks)]
        print("\n".join(report(ranks, a)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
