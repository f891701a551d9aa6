"""The SFT warm start of W1: the random-init model trained with lichen's own SFT path until it is partly right.

Used by `lichen bench learning` (both frameworks learn from it) and by `lichen bench rl`'s W1 (rewards are mixed
from it, so every sample has a non-zero advantage somewhere in its group and both frameworks do the same
forward + backward on every sample; from random init every reward is 0).

Procedure: `lichen make-tiny-model` (the workload's random-init checkpoint), then SFT with
`lichen train --loss-type sft_loss --rollout-function-path lichen.rollout.sft.generate_rollout` on correct sums
a+b, 10 <= a, b <= 49 (the W1 prompt range), minus a held-out set on which greedy accuracy is measured.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

from lichen_bench.children import run_child, tail
from lichen_bench.workloads import LICHEN_REWARD_PATHS, Workload, ensure_checkpoint, write_prompts

OPERANDS = (10, 49)  # the operand range of the W1 prompts (lichen_bench.workloads.make_prompts)


def add_sft_args(p: argparse.ArgumentParser, *, warm_start_flag: str = "--warm-start") -> None:
    """The "SFT warm start" flag group, shared by the benchmarks that start W1 from it."""
    g = p.add_argument_group("SFT warm start")
    g.add_argument(
        warm_start_flag,
        dest="warm_start",
        default=None,
        help="use this HF checkpoint as the W1 warm start and skip SFT",
    )
    g.add_argument("--sft-steps", type=int, default=300, help="SFT optimizer steps (default: 300)")
    g.add_argument("--sft-batch", type=int, default=32, help="sums per SFT step (default: 32)")
    g.add_argument("--sft-lr", type=float, default=1e-3, help="SFT learning rate, constant (default: 1e-3)")
    g.add_argument(
        "--sft-heldout",
        type=int,
        default=200,
        help="sums held out of SFT to measure the warm start's greedy accuracy (default: 200)",
    )
    g.add_argument("--sft-seed", type=int, default=0, help="seed of the SFT run and its data split (default: 0)")


def write_sft_data(d: str, heldout: int, seed: int) -> tuple[str, str, int]:
    """All pairs in the W1 operand range, shuffled by `seed`; the first `heldout` are for measuring accuracy only."""
    lo, hi = OPERANDS
    pairs = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
    random.Random(seed).shuffle(pairs)
    held, train = pairs[:heldout], pairs[heldout:]
    paths = os.path.join(d, "sft_train.jsonl"), os.path.join(d, "sft_heldout.jsonl")
    for path, rows in zip(paths, (train, held)):
        write_prompts(path, [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a, b in rows])
    return paths[0], paths[1], len(train)


def sft_flags(wl: Workload, a: argparse.Namespace, *, checkpoint: str, train: str, heldout: str, out: str) -> list[str]:
    """`lichen ...` argv of the SFT run: -log p(label + EOS | prompt), constant lr, one held-out eval at the end."""
    return [
        "train",
        "--hf-checkpoint",
        checkpoint,
        "--device",
        "cpu",
        "--num-threads",
        str(a.threads),
        "--seed",
        str(a.sft_seed),
        "--prompt-data",
        train,
        "--rollout-shuffle",
        "--rollout-seed",
        str(a.sft_seed),
        "--custom-rm-path",
        LICHEN_REWARD_PATHS[wl.reward],
        "--loss-type",
        "sft_loss",
        "--rollout-function-path",
        "lichen.rollout.sft.generate_rollout",
        "--disable-rewards-normalization",  # SFT has no rewards; a group of 1 needs this
        "--rollout-batch-size",
        str(a.sft_batch),
        "--n-samples-per-prompt",
        "1",
        "--micro-batch-size",
        str(a.sft_batch),
        "--num-rollout",
        str(a.sft_steps),
        "--lr",
        repr(a.sft_lr),
        "--lr-decay-style",
        "constant",
        # greedy accuracy on the held-out sums once, after the last step
        "--eval-prompt-data",
        "heldout",
        heldout,
        "--eval-interval",
        str(a.sft_steps),
        "--skip-eval-before-train",
        "--eval-temperature",
        "0",
        "--eval-max-response-len",
        str(wl.max_new_tokens),
        "--save",
        os.path.join(out, "checkpoints"),
        "--output-dir",
        out,
        "--no-progress",
    ]


def _latest_hf(save_dir: str) -> str:
    marker = os.path.join(save_dir, "latest_checkpointed_iteration.txt")
    with open(marker, encoding="utf-8") as f:
        hf = os.path.join(save_dir, f"iter_{int(f.read().strip()):07d}", "hf")
    if not os.path.isfile(os.path.join(hf, "config.json")):
        raise FileNotFoundError(f"{hf} has no config.json")
    return hf


def sft_warm_start(wl: Workload, a: argparse.Namespace, base: str, init_dir: str) -> dict:
    """Make the workload's checkpoint in `init_dir` (kept when there), SFT it into `base`/sft, a new directory
    (metrics.jsonl is appended to and --save would hold stale iterations), and return the warm start's path and
    held-out greedy accuracy."""
    ckpt = ensure_checkpoint(wl, init_dir)
    out = os.path.join(base, "sft")
    os.makedirs(out)  # FileExistsError: the caller passed a directory that is not fresh
    train, heldout, n_train = write_sft_data(base, a.sft_heldout, a.sft_seed)
    flags = sft_flags(wl, a, checkpoint=ckpt, train=train, heldout=heldout, out=out)
    print(
        f"[warm start] SFT: {a.sft_steps} steps x {a.sft_batch} sums (of {n_train}), lr {a.sft_lr}, from {ckpt}",
        flush=True,
    )
    child = run_child(
        [sys.executable, "-m", "lichen.cli", *flags],
        os.path.join(base, "sft.log"),
        timeout=a.timeout,
        threads=a.threads,
    )
    try:
        hf = _latest_hf(os.path.join(out, "checkpoints"))
    except (OSError, ValueError) as e:
        raise RuntimeError(f"SFT failed (rc {child['rc']}, {e}); log {child['log']}:\n{tail(child['log'])}") from e
    acc = None
    from lichen.observe.metrics import read_metrics

    for m in read_metrics(out):
        if m.get("eval/heldout/reward_mean") is not None:
            acc = m["eval/heldout/reward_mean"]
    return {
        "checkpoint": hf,
        "init_checkpoint": ckpt,
        "heldout_accuracy": acc,
        "heldout": a.sft_heldout,
        "wall_s": child["wall_s"],
        "cpu_s": child["cpu_s"],
        "flags": flags,
    }


def check_sft_args(a: argparse.Namespace, warm_start_flag: str = "--warm-start") -> None:
    """ConfigError naming the flag for SFT settings that cannot work (see `add_sft_args`)."""
    from lichen.errors import ConfigError

    for flag, value in (("--sft-steps", a.sft_steps), ("--sft-batch", a.sft_batch), ("--sft-heldout", a.sft_heldout)):
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    span = OPERANDS[1] - OPERANDS[0] + 1
    if a.sft_heldout >= span * span:
        raise ConfigError(f"--sft-heldout {a.sft_heldout} leaves no SFT data ({span * span} sums in all); lower it")
    if a.warm_start and not os.path.isfile(os.path.join(a.warm_start, "config.json")):
        raise ConfigError(f"{warm_start_flag} {a.warm_start!r} has no config.json; pass an HF checkpoint directory")
