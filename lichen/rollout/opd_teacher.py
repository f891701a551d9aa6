"""--use-opd --opd-type sglang: the teacher's log-probs of each response, asked of its engine servers.

The teacher is a frozen model of --sglang-config (lichen.config.rollout_config.opd_teacher_name). After a rollout step's
samples are made, each sample's tokens go to the teacher's servers as slime's on-policy-distillation reward sends
them (max_new_tokens 0, return_logprob, logprob_start_len 0, the rollout temperature; lichen.engines.clients.frozen_models
.FrozenModels.score), and the log-probs of the response tokens are stored in `sample.teacher_log_probs`. The trainer
then adds -opd_kl_coef * (log pi - log pi_teacher) to the advantages (lichen.train.advantage), exactly as with the
teacher it scores itself under --opd-type megatron; the rollout time includes the teacher's.
"""

from __future__ import annotations

import asyncio
import time

from lichen.config.rollout_config import opd_teacher_name
from lichen.engines.clients.frozen_models import FrozenModels
from lichen.types import Sample


def attach_teacher_log_probs(
    groups: list[list[Sample]], models: FrozenModels, *, temperature: float, concurrency: int
) -> dict[str, float]:
    """Set `teacher_log_probs` (one per response token; [] for an empty response) on every sample; returns the
    metrics `time/opd_teacher` (seconds) and `rollout/opd_teacher_log_prob_mean` (over response tokens)."""
    name = opd_teacher_name(models.names)
    samples = [s for g in groups for s in g]
    t0 = time.perf_counter()

    async def all_of_them() -> None:
        gate = asyncio.Semaphore(max(1, concurrency))

        async def one(s: Sample) -> None:
            n = int(s.response_length)
            if n <= 0:
                s.teacher_log_probs = []
                return
            async with gate:
                s.teacher_log_probs = await models.score(name, list(s.tokens), len(s.tokens) - n, temperature)

        await asyncio.gather(*(one(s) for s in samples))

    asyncio.run(all_of_them())
    values = [v for s in samples for v in s.teacher_log_probs or []]
    return {
        "time/opd_teacher": time.perf_counter() - t0,
        "rollout/opd_teacher_log_prob_mean": sum(values) / len(values) if values else 0.0,
    }
