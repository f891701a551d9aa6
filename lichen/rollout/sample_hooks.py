"""`--rollout-sample-hook-path`: user hooks run on each generated Sample before its reward, as slime's.

A hook is named by dotted path (the flag may be repeated; hooks run in the order given) and called as

    hook(args, sample, *, rollout_id=None, evaluation=False) -> Sample | None

sync or async; only the keyword arguments its signature accepts are passed (all of them to one taking **kwargs).
None keeps the sample as the hook left it (edited in place or not); a returned Sample takes the sample's place:
its fields are copied into the sample object, so the groups holding it see the hook's result. Anything else stops
the run with an error naming the flag and the hook. Hooks run in lichen's rollout (training, dynamic-sampling
rounds, eval, the fully-async worker) wherever lichen scores samples; a --rollout-function-path plug-in calls them
itself if it wants them (`apply_sample_hooks`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from typing import Any, Callable

from lichen.errors import ConfigError
from lichen.plugins import load_function
from lichen.types import Sample

FLAG = "--rollout-sample-hook-path"


def load_hooks(paths: tuple[str, ...] | list[str]) -> list[tuple[str, Callable[..., Any]]]:
    """(path, function) of each hook; a path that does not load is a ConfigError naming the flag."""
    return [(path, load_function(path, FLAG)) for path in paths]


def _accepted(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments `fn` takes: all with **kwargs, else those its signature names."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature: positional only
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


async def _apply(hooks: list[tuple[str, Callable[..., Any]]], args: Any, sample: Sample, kwargs: dict) -> None:
    for path, hook in hooks:
        result = hook(args, sample, **_accepted(hook, kwargs))
        if inspect.isawaitable(result):
            result = await result
        if result is None or result is sample:
            continue
        if not isinstance(result, Sample):
            raise ConfigError(
                f"{FLAG} {path!r}: the hook returned {type(result).__name__}; it must return a Sample or None"
            )
        for f in dataclasses.fields(Sample):  # the sample object stays in its group; its contents are the hook's
            setattr(sample, f.name, getattr(result, f.name))


def apply_sample_hooks(
    paths: tuple[str, ...] | list[str],
    args: Any,
    samples: list[Sample],
    *,
    rollout_id: int | None = None,
    evaluation: bool = False,
) -> None:
    """Run the hooks of `paths` on each of `samples` in order (see the module docstring). For synchronous callers:
    async hooks run on an event loop of this call."""
    if not paths or not samples:
        return
    hooks = load_hooks(paths)
    kwargs = {"rollout_id": rollout_id, "evaluation": evaluation}

    async def run_all() -> None:
        for sample in samples:
            await _apply(hooks, args, sample, kwargs)

    asyncio.run(run_all())
