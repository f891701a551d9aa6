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

import torch
import torch.multiprocessing as mp

from lichen.config import TrainerConfig, parse_train_args
from lichen.train.dist_trainer import DistTrainer
from lichen.types import Sample

from helpers.trainer import ragged_samples


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    return ["--hf-checkpoint", tiny_ckpt, "--prompt-data", data, "--custom-rm-path", "loop_plugins.digit_fraction",
            "--rollout-batch-size", "3", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "14",
            "--lr", "1e-3", "--clip-grad", "0", "--num-rollout", "4", "--micro-batch-size", "2",
            "--output-dir", out, "--no-progress", *extra]


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


def _trainer(argv, rank, world_size, port) -> DistTrainer:
    cfg, args = config(argv)
    return DistTrainer(cfg, args, rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port)


def _vocab(trainer: DistTrainer) -> int:
    return trainer.model.cfg.vocab_size


def grads_worker(rank: int, world_size: int, argv: list[str], port: int, out: str, steps: int) -> None:
    """Step 0's full gradients, then every step's metrics."""
    torch.set_num_threads(1)
    t = _trainer(argv, rank, world_size, port)
    metrics = [t.train(0, step_batch(_vocab(t), 0))]
    grads = {n: p.grad.full_tensor() for n, p in t.model.named_parameters()}
    metrics += [t.train(k, step_batch(_vocab(t), k)) for k in range(1, steps)]
    weights = t.full_state_dict()
    torch.save({"grads": grads, "metrics": metrics, "weights": weights}, os.path.join(out, f"rank{rank}.pt"))
    t.close()


def resume_worker(rank: int, world_size: int, argv: list[str], ports: list[int], out: str, ckpt: str,
                  steps: int) -> None:
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
    t.save(ckpt, half - 1)
    t.close()
    t = _trainer(argv, rank, world_size, ports[2])
    start = t.load(ckpt) + 1
    loaded = t.full_state_dict()
    for k in range(start, steps):
        t.train(k, step_batch(_vocab(t), k))
    torch.save({"straight": straight, "at_save": at_save, "loaded": loaded, "resumed": t.full_state_dict(),
                "start": start}, os.path.join(out, f"rank{rank}.pt"))
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
    t.save(ckpt, rollout_id)
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
