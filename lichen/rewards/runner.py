"""Running verifiers over a batch of samples, so that one bad verifier call never stops a run.

A reward function has the `--custom-rm-path` signature `fn(args, sample) -> float | dict` (plain or `async def`).
`score_samples` calls it on every sample concurrently (at most `concurrency` calls in flight, each limited to
`timeout` seconds) and writes `sample.reward`. A call that raises (anything: also `SystemExit` or another
`BaseException`; only `KeyboardInterrupt` stops the run), runs past its timeout, or returns a number that is not
finite or whose magnitude exceeds MAX_ABS_REWARD (for a dict: any such numeric value) marks that sample
`Status.FAILED` with the cause in `sample.metadata["reward_error"]`; the trainer gives failed samples zero weight
(docs/architecture.md#failed-samples). Each failure is logged with its sample index and cause (the first
MAX_LOGGED_FAILURES per batch one line each).

Under `--group-rm` the function is `fn(args, samples) -> list[reward]` and is called once per prompt group
(samples grouped by `group_index`): the timeout then applies per group, a raise or timeout fails the whole group,
and a non-finite value fails only its sample. A reward function with a `batch_context()` async context manager
(the hub, for its HTTP session) has it entered around the whole batch.

Synchronous verifiers run on daemon threads rather than `asyncio.to_thread`: a thread cannot be killed, and
`asyncio.run` waits for the default executor's threads on exit, so a verifier hung in C code would hang the whole
step. A timed-out call's thread is abandoned (it finishes or dies with the process); its late result is dropped.
The daemon threads are reused across calls and batches (`_DaemonPool`): starting a thread per call was most of
the cost of scoring a batch of cheap verifiers. A thread stuck in a hung call is never idle, so the pool starts a
new one whenever no idle thread is free: hung calls cannot exhaust it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import numbers
import os
import queue
import threading
import time
from typing import Any, Awaitable, Callable, Union

from lichen.errors import ConfigError
from lichen.observe.phases import phase
from lichen.observe.secrets import redact_text
from lichen.plugins import load_function
from lichen.rewards.hub import RewardHub, known_rm_types
from lichen.types import Sample, Status

logger = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 16
DEFAULT_TIMEOUT_S = 60.0
CANCEL_GRACE_S = 5.0  # how long a timed-out async verifier may take to unwind after its cancellation
POOL_IDLE_EXIT_S = 60.0  # an idle pooled verifier thread ends after this long without a call
MAX_LOGGED_FAILURES = 20  # failures logged one line each per batch; the rest are counted
# The trainer takes rewards as float32 and squares and sums them over a batch for group statistics; beyond 1e15
# those overflow to inf (float32 tops out at 3.4e38) and every advantage of the batch turns nan. No verifier means
# a reward that large, so it is a bug of the verifier: the sample fails rather than poisoning its batch.
MAX_ABS_REWARD = 1e15

RewardValue = Union[float, dict]
RewardFn = Callable[[Any, Sample], Union[RewardValue, Awaitable[RewardValue]]]


class GroupReward:
    """`--group-rm`: a custom `fn(args, samples: list[Sample]) -> list[reward]` scoring one prompt group per call."""

    is_group = True

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004

    def __call__(self, args: Any, samples: list[Sample]) -> Any:
        return self.fn(args, samples)

    def __repr__(self) -> str:
        return f"GroupReward({getattr(self.fn, '__qualname__', self.fn)!r})"


def build_reward_fn(
    rm_type: str | None, custom_rm_path: str | None, cfg: Any = None, *, group: bool = False
) -> RewardFn:
    """`--custom-rm-path` (taking precedence) loaded as `fn(args, sample)` (as `fn(args, samples)` of one group
    when `group`, --group-rm), else the hub's `--rm-type` grader set up with `cfg` (lichen's RewardConfig)."""
    if custom_rm_path:
        fn = load_function(custom_rm_path, "--custom-rm-path")
        return GroupReward(fn) if group else fn
    if group:
        raise ConfigError("--group-rm scores whole groups with your function: it needs --custom-rm-path")
    if rm_type:
        return RewardHub(rm_type, cfg)
    raise ConfigError(
        f"no reward function: give --rm-type (one of {', '.join(known_rm_types())}) or --custom-rm-path module.function"
    )


def score_samples(
    samples: list[Sample],
    reward_fn: RewardFn,
    args: Any,
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
    timeout: float | None = DEFAULT_TIMEOUT_S,
) -> dict:
    """Score `samples` in place; returns {"reward_time_s", "num_failed", "failed": [(sample.index, cause), ...]}.

    `concurrency` and `timeout` (seconds per call; None: unbounded) are --reward-concurrency and --reward-timeout
    in lichen's rollout (RewardConfig); `args` is only handed to the reward functions.

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
    concurrency: int = DEFAULT_CONCURRENCY,
    timeout: float | None = DEFAULT_TIMEOUT_S,
) -> dict:
    """The coroutine behind `score_samples`, for callers that already run an event loop."""
    if concurrency < 1:
        raise ValueError(f"reward concurrency must be at least 1, got {concurrency}")
    if timeout is not None and timeout <= 0:
        raise ValueError(f"reward timeout must be positive or None, got {timeout}")
    start = time.perf_counter()
    semaphore = asyncio.Semaphore(concurrency)
    inline = bool(getattr(reward_fn, "run_inline", False))
    is_async = getattr(reward_fn, "is_async", None)
    if is_async is None:
        is_async = inspect.iscoroutinefunction(reward_fn) or inspect.iscoroutinefunction(
            getattr(reward_fn, "__call__", None)  # noqa: B004
        )

    async def invoke(payload: Any) -> tuple[Any, str | None]:
        """(result, None) or (None, failure cause) of one call on a sample (or a group under --group-rm)."""
        async with semaphore:
            if inline:
                try:
                    return reward_fn(args, payload), None
                except KeyboardInterrupt:
                    raise _Interrupted() from None
                except BaseException as e:  # the verifier's own failure (even SystemExit): the run goes on
                    return None, _cause(e)
            task = asyncio.ensure_future(_call(reward_fn, args, payload, is_async))
            # asyncio.wait, not wait_for: a verifier's own TimeoutError must read as its error, not ours
            done, _ = await asyncio.wait({task}, timeout=timeout)
            if not done:
                task.cancel()
                # let it clean up (e.g. the code sandbox kills and reaps its process group), within bounds
                await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
                return None, f"timeout after {float(timeout)} s"  # type: ignore[arg-type]
            # the task is done and nobody cancelled it: a cancellation or any other exception is the verifier's
            if task.cancelled():
                return None, "CancelledError: the verifier cancelled itself"
            error = task.exception()
            if error is None:
                return task.result(), None
            if isinstance(error, _Interrupted):
                raise error
            return None, _cause(error)

    def store(sample: Sample, result: Any, cause: str | None) -> str | None:
        if cause is not None:
            return _fail(sample, cause, 0.0)
        value, cause = _check_reward(result)
        if cause is not None:
            return _fail(sample, cause, value)
        sample.reward = value
        if sample.metadata:
            sample.metadata.pop("reward_error", None)  # a stale error from an earlier scoring
        return None

    async def score_one(sample: Sample) -> list[str | None]:
        return [store(sample, *(await invoke(sample)))]

    async def score_group(group: list[Sample]) -> list[str | None]:
        result, cause = await invoke(group)
        if cause is None and (not isinstance(result, (list, tuple)) or len(result) != len(group)):
            got = f"{len(result)} values" if isinstance(result, (list, tuple)) else type(result).__name__
            cause = f"TypeError: --group-rm function must return one reward per sample ({len(group)}), got {got}"
        if cause is not None:
            return [store(s, None, cause) for s in group]
        return [store(s, r, None) for s, r in zip(group, result)]

    if getattr(reward_fn, "is_group", False):
        groups = _by_group(samples)
        ordered = [s for g in groups for s in g]
        jobs = [score_group(g) for g in groups]
    else:
        ordered, jobs = list(samples), [score_one(s) for s in samples]
    context = getattr(reward_fn, "batch_context", None)
    # a named phase, so the hang watchdog and the trace can tell the verifier's time from the engines'
    with phase("reward", num_samples=len(samples)):
        async with context() if context is not None else contextlib.nullcontext():
            try:
                causes = [c for part in await asyncio.gather(*jobs) for c in part]
            except _Interrupted:
                raise KeyboardInterrupt from None  # the run stops, as on Ctrl-C
    failed = sorted(((s.index, c) for s, c in zip(ordered, causes) if c is not None), key=lambda f: f[0])
    _log_failures(failed, len(samples))
    return {"reward_time_s": time.perf_counter() - start, "num_failed": len(failed), "failed": failed}


def _by_group(samples: list[Sample]) -> list[list[Sample]]:
    """Samples grouped by `group_index`, groups in order of first appearance, samples in their given order."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s)
    return list(groups.values())


def _log_failures(failed: list[tuple[int, str]], total: int) -> None:
    if not failed:
        return
    logger.warning("reward failed for %d of %d samples (marked failed, zero weight)", len(failed), total)
    for index, cause in failed[:MAX_LOGGED_FAILURES]:
        logger.warning("  reward failed: sample %d: %s", index, cause)
    if len(failed) > MAX_LOGGED_FAILURES:
        logger.warning("  ... and %d more failed samples", len(failed) - MAX_LOGGED_FAILURES)


def _fail(sample: Sample, cause: str, reward: RewardValue) -> str:
    cause = redact_text(cause)  # e.g. a reward server's error that echoes the key it was sent
    sample.status = Status.FAILED
    sample.reward = reward
    if sample.metadata is None:
        sample.metadata = {}
    sample.metadata["reward_error"] = cause
    return cause


def _cause(error: BaseException) -> str:
    if isinstance(error, VerifierExit):
        return str(error)
    return f"{type(error).__name__}: {error}"


def _out_of_range(value: float) -> str | None:
    if not math.isfinite(value):
        return f"non-finite reward {value}"
    if abs(value) > MAX_ABS_REWARD:
        return f"reward {value:g} is out of range (|reward| must be at most {MAX_ABS_REWARD:g})"
    return None


def _check_reward(result: Any) -> tuple[RewardValue, str | None]:
    """(value to store, failure cause or None): floats must be finite and at most MAX_ABS_REWARD in magnitude; a
    dict's numeric values too."""
    if isinstance(result, dict):
        for key, v in result.items():
            if isinstance(v, numbers.Real) and not isinstance(v, bool):
                cause = _out_of_range(float(v))
                if cause is not None:
                    return result, f"{cause} at key {key!r}"
        return result, None
    if isinstance(result, numbers.Real) or (result is not None and hasattr(result, "__float__")):
        try:
            value = float(result)
        except (TypeError, ValueError) as e:  # e.g. a multi-element tensor
            return 0.0, f"TypeError: reward {type(result).__name__} is not a scalar: {e}"
        cause = _out_of_range(value)
        return (0.0, cause) if cause is not None else (value, None)
    return 0.0, f"TypeError: reward must be a float or a dict, got {type(result).__name__}"


class VerifierExit(Exception):
    """A verifier called `sys.exit()` (raised SystemExit): its sample fails; the run goes on."""


class _Interrupted(Exception):
    """A verifier raised KeyboardInterrupt. It travels out of the scoring tasks as an ordinary exception and is
    raised again as KeyboardInterrupt by `score_samples_async` itself: a KeyboardInterrupt leaving a task breaks
    out of the event loop at once and leaves that task's exception unretrieved (asyncio then logs a traceback)."""


async def _call(fn: RewardFn, args: Any, payload: Any, is_async: bool) -> Any:
    try:
        result = fn(args, payload) if is_async else await in_daemon_thread(fn, args, payload)
        # a plain function may still hand back an awaitable (e.g. it returns a coroutine)
        if inspect.isawaitable(result):
            result = await result
    except SystemExit as e:
        # asyncio lets SystemExit out of a task through the event loop, which would end the run: re-raised as
        # an ordinary exception, it stays this call's failure
        raise VerifierExit(f"SystemExit: the verifier exited (code {e.code!r})") from None
    except KeyboardInterrupt:
        raise _Interrupted() from None
    return result


class _DaemonPool:
    """Daemon threads that run synchronous verifier calls, reused from call to call.

    A call goes to an idle thread when there is one, else to a new thread: a thread stuck in a hung (abandoned)
    call is not idle, so it is replaced rather than waited for. Idle threads end after POOL_IDLE_EXIT_S.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = 0  # threads waiting for a job, not yet promised one

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._idle:
                self._idle -= 1
                # queued under the lock, so a thread that gives up waiting just now sees it (see _work)
                self._jobs.put(job)
                return
        # a new thread starts with this job in hand: if it cannot start, the error is this call's, as it was
        # before the pool, and no queued job is left to run later
        threading.Thread(target=self._work, args=(job,), daemon=True, name="lichen-reward").start()

    def _work(self, job: Callable[[], None]) -> None:
        while True:
            job()
            with self._lock:
                self._idle += 1
            while True:
                try:
                    job = self._jobs.get(timeout=POOL_IDLE_EXIT_S)
                    break
                except queue.Empty:
                    with self._lock:
                        if self._jobs.empty():
                            self._idle -= 1  # this thread was counted idle; it ends
                            return
                    # a job was promised to an idle thread just as this one timed out: take it

    def idle_threads(self) -> int:
        with self._lock:
            return self._idle


_POOL = _DaemonPool()


def _new_pool_after_fork() -> None:
    # a forked child has none of the parent's threads: its pool must not count them as idle
    global _POOL
    _POOL = _DaemonPool()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_pool_after_fork)


def in_daemon_thread(fn: Callable[..., Any], *fn_args: Any) -> asyncio.Future:
    """A future of `fn(*fn_args)` run on a pooled daemon thread; cancelling the future abandons the call (its
    late result is dropped)."""
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

    _POOL.submit(target)
    return future
