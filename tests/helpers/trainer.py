"""Building a TrainActor and ragged samples for trainer-level tests."""

from __future__ import annotations

import contextlib
import copy
import random
from collections.abc import Iterator

import torch

from lichen.config import TrainerConfig, parse_train_args
from lichen.train.actor import TrainActor
from lichen.types import Sample, Status


def ragged_samples(vocab: int, n: int = 12, group: int = 4, seed: int = 0, max_resp: int = 14) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, r = rng.randint(2, 7), rng.randint(1, max_resp)
        tokens = [rng.randrange(3, vocab) for _ in range(p + r)]
        out.append(
            Sample(
                tokens=tokens,
                response_length=r,
                reward=0.0,
                status=Status.COMPLETED,
                group_index=i // group,
                index=i,
                rollout_log_probs=[-2.0] * r,
            )
        )
    return out


def make_actor(tiny_ckpt, addition_data, tmp_path, *extra) -> TrainActor:
    args = parse_train_args(
        [
            "--hf-checkpoint",
            tiny_ckpt,
            "--prompt-data",
            addition_data,
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
            "1",
            "--output-dir",
            str(tmp_path / "out"),
            "--no-progress",
            *extra,
        ]
    )
    return TrainActor(TrainerConfig.from_args(args), plugin_args=args)


@contextlib.contextmanager
def recorded_grads(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[list[dict[str, torch.Tensor]]]:
    """The gradients every optimizer step inside the block sees, by parameter name (copies, DTensors stay
    DTensors). The trainer frees them once the optimizer stepped (lichen.train.optim.clip_and_step), so a test
    reads them here; a skipped step records nothing."""
    seen: list[dict[str, torch.Tensor]] = []

    def record(*_: object) -> None:
        seen.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    handle = optimizer.register_step_pre_hook(record)
    try:
        yield seen
    finally:
        handle.remove()


def grads_of_step(actor: TrainActor, samples: list[Sample], **switches: object) -> tuple[dict, dict]:
    """(gradients by parameter name, metrics) of one train step on a copy of `actor` (its attributes in
    `switches` set first), the global batch `samples` in one rollout."""
    a = copy.deepcopy(actor)
    for k, v in switches.items():
        setattr(a, k, v)
    with recorded_grads(a.model, a.optimizer) as seen:
        metrics = a.train(0, [samples])
    return seen[0], metrics
