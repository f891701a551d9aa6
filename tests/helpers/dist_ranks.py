"""Running DistTrainer ranks in torch.multiprocessing children for tests: free ports, argv, batches, workers.

Each worker writes what its rank saw to `out/rank{r}.pt`, so tests assert on every rank's results, not only on
exit codes. Workers close their trainer (barrier, then destroy the process group) before returning.
"""

from __future__ import annotations

import faulthandler
import os
import random
import socket
import sys

import pytest
import torch
import torch.multiprocessing as mp

from helpers.trainer import ragged_samples, recorded_grads
from lichen.config import TrainerConfig, parse_train_args
from lichen.train import checkpoint
from lichen.train.actor import TrainActor
from lichen.train.dist_trainer import DistTrainer
from lichen.types import Sample


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free now (each held open until all are chosen): one per process group a test starts.
    An adjacent port (`port + 1`) is not one: another test's connection may hold it."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _rank_main(rank: int, worker, world_size: int, *args) -> None:
    # A rank killed by a signal prints every thread's Python stack, so a rare failure says where it happened.
    faulthandler.enable(all_threads=True)
    worker(rank, world_size, *args)
    # The gloo group outlives destroy_process_group under FSDP2 (DistTrainer.close); its threads torn down with
    # the interpreter aborted a rank now and then ("terminate called without an active exception") after all its
    # work was written. End the rank as Ray ends an actor: no teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(worker, world_size: int, *args) -> None:
    """`worker(rank, world_size, *args)` in `world_size` spawned children; raises if any of them fails."""
    mp.spawn(_rank_main, args=(worker, world_size, *args), nprocs=world_size, join=True)


def trainer_argv(tiny_ckpt: str, data: str, out: str, *extra: str) -> list[str]:
    return [
        "--hf-checkpoint",
        tiny_ckpt,
        "--prompt-data",
        data,
        "--custom-rm-path",
        "loop_plugins.digit_fraction",
        "--rollout-batch-size",
        "3",
        "--n-samples-per-prompt",
        "4",
        "--rollout-max-response-len",
        "14",
        "--lr",
        "1e-3",
        "--clip-grad",
        "0",
        "--num-rollout",
        "4",
        "--micro-batch-size",
        "2",
        "--output-dir",
        out,
        "--no-progress",
        *extra,
    ]


def config(argv: list[str]):
    args = parse_train_args(argv)
    return TrainerConfig.from_args(args), args


def step_batch(vocab: int, step: int) -> list[list[Sample]]:
    """Rollout step `step`'s groups: ragged lengths, random rewards, except the first group's, all equal (zero
    advantages: its samples are skipped, a decision taken on the global batch)."""
    samples = ragged_samples(vocab, seed=100 + step)
    rng = random.Random(step)
    for s in samples:
        s.reward = 0.5 if s.group_index == 0 else rng.random()
    return [samples[i : i + 4] for i in range(0, len(samples), 4)]


def save(t: DistTrainer, ckpt: str, rollout_id: int) -> None:
    """Checkpoint `rollout_id` as a run saves it: every rank's part (DistTrainer.save), then what the driver
    writes (lichen.train.checkpoint.commit), here on rank 0, with an empty rollout state."""
    if t.rank == 0:
        checkpoint.begin_save(ckpt, rollout_id)
    saved = t.save(ckpt, rollout_id)
    if t.rank == 0:
        checkpoint.commit(ckpt, rollout_id, saved, {})


def async_save_begin(t: DistTrainer, ckpt: str, rollout_id: int) -> None:
    """What the driver does with --async-save on Ray, here on rank 0: begin, then every rank stages and starts its
    write (the next step may run before async_commit)."""
    if t.rank == 0:
        checkpoint.begin_save(ckpt, rollout_id)
    assert t.save_async(ckpt, rollout_id) is True


def async_commit(t: DistTrainer, ckpt: str, rollout_id: int) -> None:
    """Every rank's entries of the write async_save_begin started, merged and committed (the driver's part)."""
    import torch.distributed as dist

    parts: list = [None] * t.world_size
    dist.all_gather_object(parts, t.save_done().files)  # the driver gathers them through Ray
    if t.rank == 0:
        files = {rel: e for part in parts for rel, e in part.items()}
        checkpoint.commit(ckpt, rollout_id, checkpoint.SavedTrainer(files, world_size=t.world_size), {})


def _trainer(argv, rank, world_size, port) -> DistTrainer:
    cfg, args = config(argv)
    return DistTrainer(cfg, args, rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port)


def _vocab(trainer: DistTrainer) -> int:
    return trainer.model.cfg.vocab_size


def grads_worker(rank: int, world_size: int, argv: list[str], port: int, out: str, steps: int) -> None:
    """Step 0's full gradients, then every step's metrics."""
    torch.set_num_threads(1)
    t = _trainer(argv, rank, world_size, port)
    with recorded_grads(t.model, t.actor.optimizer) as seen:
        metrics = [t.train(0, step_batch(_vocab(t), 0))]
    grads = {n: g.full_tensor() for n, g in seen[0].items()}
    metrics += [t.train(k, step_batch(_vocab(t), k)) for k in range(1, steps)]
    weights = t.full_state_dict()
    torch.save({"grads": grads, "metrics": metrics, "weights": weights}, os.path.join(out, f"rank{rank}.pt"))
    t.close()


def resume_worker(
    rank: int, world_size: int, argv: list[str], ports: list[int], out: str, ckpt: str, steps: int
) -> None:
    """N steps straight; N/2 steps + save; load + N/2 steps: rank 0's full weights of each."""
    torch.set_num_threads(1)
    half = steps // 2
    t = _trainer(argv, rank, world_size, ports[0])
    for k in range(steps):
        t.train(k, step_batch(_vocab(t), k))
    straight = t.full_state_dict()
    t.close()
    t = _trainer(argv, rank, world_size, ports[1])
    for k in range(half):
        t.train(k, step_batch(_vocab(t), k))
    at_save = t.full_state_dict()
    save(t, ckpt, half - 1)
    t.close()
    t = _trainer(argv, rank, world_size, ports[2])
    start = t.load(ckpt) + 1
    loaded = t.full_state_dict()
    for k in range(start, steps):
        t.train(k, step_batch(_vocab(t), k))
    torch.save(
        {"straight": straight, "at_save": at_save, "loaded": loaded, "resumed": t.full_state_dict(), "start": start},
        os.path.join(out, f"rank{rank}.pt"),
    )
    t.close()


def load_worker(rank: int, world_size: int, argv: list[str], port: int, out: str, ckpt: str, steps: int) -> None:
    """Load a checkpoint saved on another number of ranks, then train to `steps`: rank 0's full weights."""
    torch.set_num_threads(1)
    t = _trainer(argv, rank, world_size, port)
    start = t.load(ckpt) + 1
    loaded = t.full_state_dict()
    for k in range(start, steps):
        t.train(k, step_batch(_vocab(t), k))
    torch.save({"loaded": loaded, "resumed": t.full_state_dict(), "start": start}, os.path.join(out, f"rank{rank}.pt"))
    t.close()


def save_worker(rank: int, world_size: int, argv: list[str], port: int, ckpt: str, rollout_id: int) -> None:
    """One step, then checkpoint `rollout_id` in `ckpt`."""
    torch.set_num_threads(1)
    t = _trainer(argv, rank, world_size, port)
    t.train(0, step_batch(_vocab(t), 0))
    save(t, ckpt, rollout_id)
    t.close()


def load_error_worker(rank: int, world_size: int, argv: list[str], port: int, out: str, ckpt: str) -> None:
    """Load `ckpt`; write what the load raised (its type and message) or None, then leave the group."""
    torch.set_num_threads(1)
    t = _trainer(argv, rank, world_size, port)
    try:
        t.load(ckpt)
        error = None
    except Exception as e:  # recorded for the test to assert on, per rank
        error = {"type": type(e).__name__, "message": str(e)}
    torch.save({"error": error}, os.path.join(out, f"rank{rank}.pt"))
    t.close()


def rank_files(out, world_size: int) -> list[dict]:
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=True) for r in range(world_size)]


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def two_ranks_and_local(argv: list[str], tmp_path) -> tuple[list[dict], TrainActor, list[dict], dict]:
    """3 steps on 2 ranks (each rank's file) and on the single-rank TrainActor (its metrics, first-step grads)."""
    cfg, args = config(argv)  # a flag mistake shows here, not in a child
    run_ranks(grads_worker, 2, argv, free_port(), str(tmp_path), 3)
    ranks = rank_files(tmp_path, 2)
    same = [[{k: v for k, v in m.items() if not k.startswith("time/")} for m in r["metrics"]] for r in ranks]
    assert same[0] == same[1]  # every rank reports the same metrics (timings aside)
    assert ranks[1]["weights"] is None and ranks[0]["weights"] is not None
    local = TrainActor(cfg, plugin_args=args)
    vocab = local.model.cfg.vocab_size
    with recorded_grads(local.model, local.optimizer) as seen:
        metrics = [local.train(0, step_batch(vocab, 0))]
    grads = seen[0]
    metrics += [local.train(k, step_batch(vocab, k)) for k in range(1, 3)]
    assert grads.keys() == ranks[0]["grads"].keys()
    return ranks, local, metrics, grads


def assert_matches_single_rank(ranks: list[dict], local: TrainActor, metrics: list[dict], grads: dict) -> None:
    """2 ranks vs the single-rank trainer: first-step gradients within 1e-6 relative, losses over the steps within
    1e-5, the same skip decisions and critic metrics, weights after the steps within 1e-5."""
    worst = max(rel_diff(ranks[0]["grads"][n], g) for n, g in grads.items())
    print(f"first-step gradients: worst relative difference {worst:.3g}")
    assert worst <= 1e-6, worst
    for mine, ref in zip(ranks[0]["metrics"], metrics):
        print(f"loss: 2 ranks {mine['train/loss']:.9g}, 1 rank {ref['train/loss']:.9g}")
        assert abs(mine["train/loss"] - ref["train/loss"]) <= 1e-5, (mine["train/loss"], ref["train/loss"])
        assert mine["train/skipped_samples"] == ref["train/skipped_samples"]
        for key in (k for k in ref if k.startswith("critic/")):
            assert mine[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), key
    assert ranks[0]["weights"].keys() == {name for name, _ in local.model.named_parameters()}
    for name, w in local.model.named_parameters():
        assert torch.allclose(ranks[0]["weights"][name], w.detach(), rtol=0, atol=1e-5), name


def fsdp_units_worker(rank: int, world_size: int, ckpt: str, port: int, out: str) -> None:
    """Shard `ckpt`'s HF module as DistTrainer does; write the names of its FSDP2 units (the root is "")."""
    from torch.distributed.fsdp import FSDPModule

    from lichen.models.loading import load_model
    from lichen.train import fsdp

    fsdp.init_process_group(rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port, backend="gloo")
    model = load_model(ckpt, impl="hf")
    layers = fsdp.decoder_layers(model)
    fsdp.shard(model, layers=layers, bf16=False)
    units = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    torch.save({"units": units, "layers": len(layers)}, os.path.join(out, f"rank{rank}.pt"))
    torch.distributed.barrier()
