"""Building a TrainActor and ragged samples for trainer-level tests."""

from __future__ import annotations

import random

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
