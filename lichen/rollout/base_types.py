"""The rollout function contract (`--rollout-function-path`, `--eval-function-path`), as slime has it.

    fn(args, rollout_id: int, data_source, evaluation: bool = False)
        -> RolloutFnTrainOutput(samples, metrics)     (evaluation=False)
        -> RolloutFnEvalOutput(data, metrics)         (evaluation=True)

- `args`: the full resolved flag namespace (every `lichen train` flag, your own included);
- `rollout_id`: the rollout step; for evaluation, the weight version being evaluated (0 before training);
- `data_source`: the prompts (lichen.rollout.data_source.RolloutDataSource: `get_samples(n)` -> n groups of
  --n-samples-per-prompt pending Samples, buffered groups first; `add_samples(groups)` puts groups back to be
  continued next step; its position is part of every checkpoint);
- lichen's engine, tokenizer and reward functions: `lichen.rollout.context.current()` while the call runs;
- `samples`: list[list[Sample]], one group per prompt; `metrics`: extra `name -> number` logged with the step;
- `data`: eval data set name -> {"samples": list[list[Sample]] (groups, one per prompt), "rewards": [...],
  "truncated": [...]}; lichen computes `eval/<name>/<metric>` (reward mean, pass@k, ...) from the samples.

A function may return a plain list of groups (train) or the `data` dict (eval) instead: taken as the output
without metrics, as slime does. The older lichen signature `fn(args, rollout_id, prompts, manager)` still works
for one release, with a DeprecationWarning (see `RolloutFn`).
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Any, Callable

from lichen.errors import ConfigError
from lichen.observe.metrics import get_logger
from lichen.types import Sample

log = get_logger(__name__)


@dataclass
class RolloutFnTrainOutput:
    samples: list[list[Sample]]
    metrics: dict[str, Any] | None = None


@dataclass
class RolloutFnEvalOutput:
    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] | None = None


LEGACY_DEPRECATION = (
    "{flag} {path}: the signature fn(args, rollout_id, prompts, manager) is deprecated and will be removed in the "
    "next release; use fn(args, rollout_id, data_source, evaluation=False) -> RolloutFnTrainOutput "
    "(lichen.rollout.base_types), with lichen's engine, tokenizer and rewards from lichen.rollout.context.current()"
)


def is_legacy_signature(fn: Callable) -> bool:
    """True for lichen's old fn(args, rollout_id, prompts, manager): four positional parameters, no `evaluation`."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: take it for the current contract
        return False
    if "evaluation" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return False
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 4


class RolloutFn:
    """A loaded rollout function; `call` runs it under the contract and normalizes what it returns."""

    def __init__(self, fn: Callable, *, flag: str = "--rollout-function-path", path: str = "") -> None:
        self.fn = fn
        self.flag = flag
        self.legacy = is_legacy_signature(fn)
        if self.legacy:
            message = LEGACY_DEPRECATION.format(flag=flag, path=path or getattr(fn, "__qualname__", fn))
            warnings.warn(message, DeprecationWarning, stacklevel=3)
            log.warning("%s", message)  # DeprecationWarnings are hidden by default outside __main__

    def call(
        self,
        args: Any,
        rollout_id: int,
        data_source: Any,
        *,
        evaluation: bool,
        legacy_call: Callable[[], Any] | None = None,
    ) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
        """fn(args, rollout_id, data_source, evaluation=...); `legacy_call` runs an old-signature fn instead."""
        if self.legacy:
            if evaluation or legacy_call is None:
                raise ConfigError(
                    f"{self.flag}: a function with the old signature fn(args, rollout_id, prompts, "
                    "manager) cannot evaluate; give it the parameter evaluation=False"
                )
            output = legacy_call()
        else:
            output = self.fn(args, rollout_id, data_source, evaluation=evaluation)
        return normalize_output(output, evaluation=evaluation, flag=self.flag)


def normalize_output(output: Any, *, evaluation: bool, flag: str) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """The output as the dataclass `evaluation` asks for; a legacy plain list (train) or dict (eval) is wrapped."""
    want = RolloutFnEvalOutput if evaluation else RolloutFnTrainOutput
    if isinstance(output, want):
        return output
    if isinstance(output, (RolloutFnTrainOutput, RolloutFnEvalOutput)):
        raise ConfigError(
            f"{flag}: returned {type(output).__name__} for evaluation={evaluation}; return {want.__name__}"
        )
    if evaluation and isinstance(output, dict):
        return RolloutFnEvalOutput(data=output)
    if not evaluation and isinstance(output, list) and all(isinstance(g, list) for g in output):
        return RolloutFnTrainOutput(samples=output)
    raise ConfigError(
        f"{flag}: returned a {type(output).__name__}; return {want.__name__} (lichen.rollout."
        f"base_types) or {'a dict of data sets' if evaluation else 'a list of groups of Samples'}"
    )
