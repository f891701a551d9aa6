"""Running verifiers over a batch of samples, so that one bad verifier call never stops a run.

A reward function has the `--custom-rm-path` signature `fn(args, sample) -> float | dict` (plain or `async def`).
`score_samples` calls it on every sample concurrently (at most `concurrency` calls in flight, each limited to
`timeout` seconds) and writes `sample.reward`. A call that raises, runs past its timeout, or returns a non-finite
number (for a dict: any non-finite numeric value) marks that sample `Status.FAILED` with the cause in
`sample.metadata["reward_error"]`; the trainer gives failed samples zero weight (DESIGN §4).

Synchronous verifiers run on daemon threads rather than `asyncio.to_thread`: a thread cannot be killed, and
`asyncio.run` waits for the default executor's threads on exit, so a verifier hung in C code would hang the whole
step. A timed-out call's thread is abandoned (it finishes or dies with the process); its late result is dropped.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import threading
import time
from typing import Any, Awaitable, Callable, Union

from lichen.errors import ConfigError
from lichen.plugins import load_function
from lichen.rewards.rules import RULES, get_rule_reward
from lichen.types import Sample, Status

logger = logging.getLogger(__name__)

RewardValue = Union[float, dict]
RewardFn = Callable[[Any, Sample], Union[RewardValue, Awaitable[RewardValue]]]


class RuleReward:
    """A rule reward in the `(args, sample)` form; `sample.metadata["rm_type"]` overrides `--rm-type` per sample."""

    # rules are pure, bounded-time string code: running them on the event loop avoids a thread per sample
    run_inline = True

    def __init__(self, rm_type: str) -> None:
        self.rm_type = rm_type
        self.rule = get_rule_reward(rm_type)

    def __call__(self, args: Any, sample: Sample) -> RewardValue:
        metadata = sample.metadata or {}
        rm_type = metadata.get("rm_type") or self.rm_type
        rule = self.rule if rm_type == self.rm_type else RULES.get(rm_type)
        if rule is None:
            raise ValueError(
                f"sample metadata rm_type {rm_type!r} is not a known rule reward; known: {', '.join(sorted(RULES))}"
            )
        return rule(sample.response, sample.label, metadata)

    def __repr__(self) -> str:
        return f"RuleReward({self.rm_type!r})"


def build_reward_fn(rm_type: str | None, custom_rm_path: str | None, args: Any = None) -> RewardFn:
    """`--custom-rm-path` (taking precedence) loaded as `fn(args, sample)`, else the `--rm-type` rule wrapped so."""
    if custom_rm_path:
        return load_function(custom_rm_path, "--custom-rm-path")
    if rm_type:
        return RuleReward(rm_type)
    raise ConfigError(
        f"no reward function: give --rm-type (one of {', '.join(sorted(RULES))}) or --custom-rm-path "
        f"module.function"
    )


def score_samples(
    samples: list[Sample],
    reward_fn: RewardFn,
    args: Any,
    *,
    concurrency: int = 16,
    timeout: float | None = 60.0,
) -> dict:
    """Score `samples` in place; returns {"reward_time_s", "num_failed", "failed": [(sample.index, cause), ...]}.

    For synchronous callers only: it runs its own event loop with `asyncio.run`, so it must not be called from
    inside a running loop (await `score_samples_async` there instead).
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError(
            "score_samples() was called inside a running event loop; use `await score_samples_async(...)` there"
        )
    return asyncio.run(score_samples_async(samples, reward_fn, args, concurrency=concurrency, timeout=timeout))


async def score_samples_async(
    samples: list[Sample],
    reward_fn: RewardFn,
    args: Any,
    *,
    concurrency: int = 16,
    timeout: float | None = 60.0,
) -> dict:
    """The coroutine behind `score_samples`, for callers that already run an event loop."""
    if concurrency < 1:
        raise ValueError(f"reward concurrency must be at least 1, got {concurrency}")
    if timeout is not None and timeout <= 0:
        raise ValueError(f"reward timeout must be positive or None, got {timeout}")
    start = time.perf_counter()
    semaphore = asyncio.Semaphore(concurrency)
    inline = bool(getattr(reward_fn, "run_inline", False))
    is_async = inspect.iscoroutinefunction(reward_fn) or inspect.iscoroutinefunction(
        getattr(reward_fn, "__call__", None)
    )

    async def score_one(sample: Sample) -> str | None:
        async with semaphore:
            try:
                if inline:
                    result = reward_fn(args, sample)
                else:
                    task = asyncio.ensure_future(_call(reward_fn, args, sample, is_async))
                    # asyncio.wait, not wait_for: a verifier's own TimeoutError must read as its error, not ours
                    done, _ = await asyncio.wait({task}, timeout=timeout)
                    if not done:
                        task.cancel()
                        return _fail(sample, f"timeout after {float(timeout)} s", 0.0)  # type: ignore[arg-type]
                    result = task.result()
            except Exception as e:  # the verifier's own failure: recorded, the run goes on
                return _fail(sample, f"{type(e).__name__}: {e}", 0.0)
        value, cause = _check_reward(result)
        if cause is not None:
            return _fail(sample, cause, value)
        sample.reward = value
        if sample.metadata:
            sample.metadata.pop("reward_error", None)  # a stale error from an earlier scoring
        return None

    causes = await asyncio.gather(*(score_one(s) for s in samples))
    failed = [(s.index, c) for s, c in zip(samples, causes) if c is not None]
    if failed:
        logger.warning(
            "reward failed for %d of %d samples (marked failed, zero weight); first: sample %d: %s",
            len(failed), len(samples), failed[0][0], failed[0][1],
        )
    return {"reward_time_s": time.perf_counter() - start, "num_failed": len(failed), "failed": failed}


def _fail(sample: Sample, cause: str, reward: RewardValue) -> str:
    sample.status = Status.FAILED
    sample.reward = reward
    if sample.metadata is None:
        sample.metadata = {}
    sample.metadata["reward_error"] = cause
    return cause


def _check_reward(result: Any) -> tuple[RewardValue, str | None]:
    """(value to store, failure cause or None): floats must be finite; a dict's numeric values too."""
    if isinstance(result, dict):
        for key, v in result.items():
            if isinstance(v, numbers.Real) and not math.isfinite(float(v)):
                return result, f"non-finite reward {float(v)} at key {key!r}"
        return result, None
    if isinstance(result, numbers.Real) or (result is not None and hasattr(result, "__float__")):
        try:
            value = float(result)
        except (TypeError, ValueError) as e:  # e.g. a multi-element tensor
            return 0.0, f"TypeError: reward {type(result).__name__} is not a scalar: {e}"
        if not math.isfinite(value):
            return 0.0, f"non-finite reward {value}"
        return value, None
    return 0.0, f"TypeError: reward must be a float or a dict, got {type(result).__name__}"


async def _call(fn: RewardFn, args: Any, sample: Sample, is_async: bool) -> Any:
    result = fn(args, sample) if is_async else await _in_daemon_thread(fn, args, sample)
    # a plain function may still hand back an awaitable (e.g. it returns a coroutine)
    if inspect.isawaitable(result):
        result = await result
    return result


def _in_daemon_thread(fn: Callable[..., Any], *fn_args: Any) -> asyncio.Future:
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def deliver(ok: bool, value: Any) -> None:
        if future.done():  # cancelled after a timeout
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def target() -> None:
        try:
            outcome = (True, fn(*fn_args))
        except BaseException as e:  # handed to the awaiting coroutine, which decides what to catch
            outcome = (False, e)
        try:
            loop.call_soon_threadsafe(deliver, *outcome)
        except RuntimeError:  # the loop closed while this call ran past its timeout: nobody is waiting
            pass

    threading.Thread(target=target, daemon=True, name="lichen-reward").start()
    return future
