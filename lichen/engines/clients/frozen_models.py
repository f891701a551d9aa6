"""Frozen models served beside the policy (slime's `--sglang-config` entries with `update_weights: false`).

A reference, reward or teacher model gets its own engine servers (`lichen serve`, or SGLang with
`--rollout-engine-backend sglang`), launched with the policy's launch settings but its own `model_path`. They are
held here, never in the rollout's `engines`: `lichen.sync` publishes weights only to those, so a frozen model keeps
the weights it was started with for the whole run.

Plug-ins reach them by name while the run holds them (`active()`): `await active().score(name, tokens, start)`
returns the model's log-probabilities of `tokens[start:]`, and `await active().post(name, body)` sends one
`/generate` body (the servers are keyed; these calls carry the key, a bare HTTP post as slime's `get_model_url`
returns would be refused).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
from typing import TYPE_CHECKING

from lichen.config.engine_config import FrozenModelSpec
from lichen.errors import ConfigError
from lichen.observe.metrics import get_logger

if TYPE_CHECKING:
    from lichen.config.engine_config import EngineConfig
    from lichen.engines.clients.remote_engines import RemoteEngines

log = get_logger(__name__)


class FrozenModels:
    """The engine servers of every frozen model, by name. `close()` stops the ones it launched."""

    def __init__(self, engines: dict[str, "RemoteEngines"]) -> None:
        self.engines = engines

    @classmethod
    def launch(cls, specs: tuple[FrozenModelSpec, ...], policy_cfg: "EngineConfig") -> "FrozenModels":
        """Start each model's servers with the policy's launch settings (device, threads, limits, backend), its own
        checkpoint and no weight directories (nothing is ever published to them)."""
        from lichen.engines.clients.remote_engines import RemoteEngines

        out = cls({})
        try:
            for spec in specs:
                cfg = dataclasses.replace(
                    policy_cfg,
                    model_path=spec.model_path,
                    num_engines=spec.num_engines,
                    addresses=(),
                    gpus_per_engine=spec.gpus_per_engine,
                    log_dir=os.path.join(policy_cfg.log_dir, spec.name) if policy_cfg.log_dir else None,
                    failover=False,
                    required={"/generate": f"--sglang-config model {spec.name!r}"},
                    weight_dir=None,
                    local_checkpoint_dir=None,
                    memory_saver=False,
                )
                out.engines[spec.name] = RemoteEngines.from_config(cfg)
                log.info("frozen model %r: %d engine(s) on %s", spec.name, spec.num_engines, spec.model_path)
        except BaseException:
            out.close()
            raise
        return out

    @property
    def names(self) -> list[str]:
        return list(self.engines)

    def get(self, name: str) -> "RemoteEngines":
        try:
            return self.engines[name]
        except KeyError:
            raise ConfigError(
                f"no frozen model named {name!r} in --sglang-config (frozen models: {', '.join(self.names) or 'none'})"
            ) from None

    def weight_versions(self) -> dict[str, list[str | None]]:
        """What each frozen model's servers report (their initial version for the whole run)."""
        return {name: e.weight_versions() for name, e in self.engines.items()}

    async def post(self, name: str, body: dict) -> dict:
        """One `/generate` body to the model's servers (routed as the policy's are), awaitable from any event loop."""
        engines = self.get(name)
        _, out = await asyncio.wrap_future(engines.submit(engines.router.generate(body, None)))
        return out

    async def score(self, name: str, tokens: list[int], start: int, temperature: float = 1.0) -> list[float]:
        """log p(tokens[i] | tokens[:i]) under the frozen model for i >= start (as slime's OPD teacher call:
        max_new_tokens 0, return_logprob, logprob_start_len 0)."""
        if not 0 < start <= len(tokens):
            raise ValueError(f"score: start {start} outside 1..{len(tokens)}")
        body = {
            "input_ids": list(tokens),
            "sampling_params": {"max_new_tokens": 0, "temperature": temperature, "skip_special_tokens": False},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        out = await self.post(name, body)
        entries = (out.get("meta_info") or {}).get("input_token_logprobs") if isinstance(out, dict) else None
        if not isinstance(entries, list) or len(entries) != len(tokens):
            raise RuntimeError(f"frozen model {name!r}: /generate returned no input log-probs for {len(tokens)} tokens")
        values = [e[0] if isinstance(e, (list, tuple)) and e else None for e in entries[start:]]
        if not all(isinstance(v, (int, float)) for v in values):
            raise RuntimeError(f"frozen model {name!r}: /generate returned a non-numeric input log-prob")
        return [float(v) for v in values]  # type: ignore[arg-type]  # checked numeric just above

    def close(self) -> None:
        for engines in self.engines.values():
            engines.close()
        self.engines = {}


_lock = threading.Lock()
_active: FrozenModels | None = None


def set_active(models: FrozenModels | None) -> None:
    """The run's frozen models, for plug-ins (set by the rollout worker that launched them; None when it closes)."""
    global _active
    with _lock:
        _active = models


def active() -> FrozenModels:
    """The frozen models of the run in progress; a ConfigError when it serves none."""
    with _lock:
        models = _active
    if models is None or not models.engines:
        raise ConfigError(
            "no frozen model is served: describe one in --sglang-config (a model with update_weights: false)"
        )
    return models
