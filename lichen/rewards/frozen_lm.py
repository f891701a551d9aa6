"""A reward scored by a frozen model of --sglang-config: the mean log-probability of the response under it.

    --sglang-config models.yaml --custom-rm-path lichen.rewards.frozen_lm.reward_func

The frozen model (update_weights: false) is the one named `reward` or `teacher`, or the only frozen model of the
file. Each sample's tokens go to its servers as slime's on-policy-distillation reward sends them
(slime.rollout.on_policy_distillation.reward_func: max_new_tokens 0, return_logprob, logprob_start_len 0, the
rollout temperature); the reward is the mean of the response tokens' log-probs, a likelihood reward from a reference
model, and the per-token values stay in `sample.metadata["frozen_log_probs"]` for plug-ins downstream.
"""

from __future__ import annotations

from typing import Any

from lichen.engines.clients.frozen_models import FrozenModels, active
from lichen.errors import ConfigError
from lichen.types import Sample

PREFERRED = ("reward", "teacher")


def scoring_model(models: FrozenModels) -> str:
    """The frozen model this reward asks (see the module docstring)."""
    for name in PREFERRED:
        if name in models.engines:
            return name
    if len(models.names) == 1:
        return models.names[0]
    raise ConfigError(
        f"lichen.rewards.frozen_lm: {len(models.names)} frozen models ({', '.join(models.names)}); name the one to "
        f"score with {' or '.join(PREFERRED)}"
    )


async def reward_func(args: Any, sample: Sample) -> float:
    """Mean log p(response token | prefix) under the frozen model (0.0 for an empty response)."""
    n = int(sample.response_length)
    if n <= 0:
        return 0.0
    models = active()
    temperature = float(getattr(args, "rollout_temperature", 1.0) or 1.0)
    values = await models.score(scoring_model(models), list(sample.tokens), len(sample.tokens) - n, temperature)
    sample.metadata["frozen_log_probs"] = values
    return sum(values) / len(values)
