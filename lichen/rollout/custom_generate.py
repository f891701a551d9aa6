"""`--custom-generate-function-path module.fn`: your own per-sample generation inside lichen's rollout.

Contract (as slime's):

    async def fn(args, sample: Sample, sampling_params: dict) -> Sample | list[Sample]

- `sample` arrives with prompt, label, metadata, group_index and index filled, `tokens` = the encoded prompt
  (chat template applied as configured) and `response_length` = 0;
- `sampling_params` uses SGLang's `/generate` names: max_new_tokens (the response budget), temperature, top_p,
  top_k, stop_token_ids, and `sampling_seed`, this sample's seed derive_seed(--seed, rollout key, prompt, j), the
  one the default rollout would use. A function that makes several engine calls derives one seed per call from
  it (e.g. derive_seed(sampling_seed, turn)), so a retried or resumed rollout draws the same tokens;
- the function calls the engine with `await lichen.rollout.custom_generate.generate(input_ids, sampling_params)`
  (-> GenResult: output_ids, output_logprobs, finish_reason, weight_version), which works the same over the
  in-process engine and over engine servers; `current()` gives the tokenizer and args as well;
- it returns the sample with tokens = prompt + response, response_length, response, rollout_log_probs (one per
  response token), loss_mask (one per response token; 0 for tokens the policy did not produce, e.g. tool
  output; default all 1), weight_versions and status (completed / truncated / aborted / failed). A list of
  samples puts all of them in the group (the batch's indices are then renumbered in order).

Rewards, the overlong penalty and dynamic sampling then run on the returned samples as on the default ones.
All samples of a step run concurrently on one event loop: over engine servers on the engines' own loop (so each
engine call is an HTTP request routed like any other), in process on a private loop whose engine calls are
gathered into batches for `Engine.generate`, run in a worker thread. Blocking work inside the function (a tool,
a sandbox) should go through `await asyncio.to_thread(...)` so the other samples keep going.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from lichen.aio import gather_or_cancel
from lichen.engines.api.engine_protocol import AsyncEngine, BatchEngine
from lichen.engines.core.engine import GenRequest, GenResult
from lichen.engines.core.sampler import derive_seed
from lichen.errors import UserError
from lichen.plugins import load_function
from lichen.types import Sample, Status

FLAG = "--custom-generate-function-path"
# sampling_params keys a request may carry; the ones without meaning for lichen's engines are accepted and ignored.
SAMPLING_KEYS = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop_token_ids",
    "sampling_seed",
    "ignore_eos",
    "no_stop_trim",
    "skip_special_tokens",
    "spaces_between_special_tokens",
}


class CustomGenerateError(UserError):
    """The custom generate function broke its contract (the message says how)."""


@dataclass
class GenerateContext:
    """What a custom generate function can reach besides its arguments (see `current()`)."""

    args: Any
    tokenizer: Any
    engine: AsyncEngine

    async def generate(
        self, input_ids: list[int], sampling_params: dict, *, session_id: str | None = None
    ) -> GenResult:
        """One engine call; `session_id` keeps a multi-turn conversation on one server (prefix cache)."""
        return await self.engine.agenerate(request_from_params(input_ids, sampling_params), session_id)


_CONTEXT: contextvars.ContextVar[GenerateContext] = contextvars.ContextVar("lichen_generate_context")


def current() -> GenerateContext:
    """The context of the running rollout; only inside a custom generate function."""
    try:
        return _CONTEXT.get()
    except LookupError:
        raise RuntimeError(
            "lichen.rollout.custom_generate.current() is only available inside a custom generate "
            "function called by lichen's rollout"
        ) from None


async def generate(input_ids: list[int], sampling_params: dict, *, session_id: str | None = None) -> GenResult:
    """`current().generate(...)`: one engine call from a custom generate function."""
    return await current().generate(input_ids, sampling_params, session_id=session_id)


def request_from_params(input_ids: list[int], sampling_params: dict) -> GenRequest:
    """SGLang-style sampling_params -> GenRequest; an unknown key is an error (it would be silently ignored)."""
    unknown = sorted(set(sampling_params) - SAMPLING_KEYS)
    if unknown:
        raise CustomGenerateError(
            f"{FLAG}: sampling_params key(s) {unknown} are not supported by lichen's engine "
            f"requests; use {sorted(SAMPLING_KEYS)}"
        )
    if not input_ids:
        raise CustomGenerateError(f"{FLAG}: an engine call needs at least one input token")
    return GenRequest(
        input_ids=[int(t) for t in input_ids],
        max_new_tokens=int(sampling_params.get("max_new_tokens", 128)),
        temperature=float(sampling_params.get("temperature", 1.0)),
        top_p=float(sampling_params.get("top_p", 1.0)),
        top_k=int(sampling_params.get("top_k", -1)),
        stop_token_ids=[int(t) for t in sampling_params.get("stop_token_ids") or []],
        seed=int(sampling_params.get("sampling_seed", 0)),
        ignore_eos=bool(sampling_params.get("ignore_eos", False)),
    )


class BatchingEngine:
    """The in-process `Engine` behind an async `agenerate`: calls made while a batch runs are gathered and run
    as the next `Engine.generate` batch in a worker thread (one batch at a time; the engine is not re-entrant).
    `agenerate_stream` yields the generation as it grows (from `Engine.generate`'s `on_step`)."""

    def __init__(self, engine: BatchEngine):
        self.engine = engine
        # each request's queue gets (new ids, their log-probs) per step when it streams, then its GenResult or error;
        # a streaming request's Event is set when its reader stops, which stops its row
        self._queue: list[tuple[GenRequest, asyncio.Queue, threading.Event | None]] = []
        self._worker: asyncio.Task | None = None
        self.batches: list[int] = []  # size of each batch run (for tests and logs)

    async def agenerate(self, request: GenRequest, session_id: str | None = None) -> GenResult:
        item = await self._submit(request, None).get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def agenerate_stream(self, request: GenRequest, session_id: str | None = None) -> AsyncIterator[GenResult]:
        """The tokens so far after every step that added some (GenResults with finish_reason None), then the
        final GenResult, the same as `agenerate` would return. Closing it early stops the request's generation at
        the engine's next step (the rest of its batch goes on)."""
        left = threading.Event()
        out = self._submit(request, left)
        ids: list[int] = []
        lps: list[float] = []
        try:
            while True:
                item = await out.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, GenResult):
                    yield item
                    return
                ids += item[0]
                lps += item[1]
                yield GenResult(list(ids), list(lps), None, len(request.input_ids), "")
        finally:
            left.set()  # after the final result there is nothing left to stop

    def _submit(self, request: GenRequest, left: threading.Event | None) -> asyncio.Queue:
        out: asyncio.Queue = asyncio.Queue()
        self._queue.append((request, out, left))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.ensure_future(self._drain())
        return out

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._queue:
            await asyncio.sleep(0)  # let every sample that is ready to call the engine do so first
            batch, self._queue = self._queue, []
            self.batches.append(len(batch))
            requests = [r for r, _, _ in batch]
            streams = [(k, out, left) for k, (_, out, left) in enumerate(batch) if left is not None]
            # an engine of the caller's need not take on_step unless a request streams
            kwargs = {"on_step": _publisher(loop, streams)} if streams else {}
            results: list[GenResult] | list[BaseException]
            try:
                results = await asyncio.to_thread(self.engine.generate, requests, **kwargs)
            except BaseException as e:  # noqa: BLE001 - every caller of the batch gets the error
                results = [e] * len(batch)
            for (_, out, _), res in zip(batch, results):
                out.put_nowait(res)


def _publisher(loop: asyncio.AbstractEventLoop, streams: list[tuple[int, asyncio.Queue, threading.Event]]) -> Callable:
    """`Engine.generate`'s on_step for the streaming requests of a batch: each step's new tokens and log-probs
    to the request's queue, and the requests whose reader left, to stop. It runs in the worker thread between
    steps, when the seqs hold still."""
    sent = {k: 0 for k, _, _ in streams}
    stopped: set[int] = set()

    def on_step(seqs: list) -> list[int]:
        for k, out, _ in streams:
            seq, a = seqs[k], sent[k]
            n = sent[k] = len(seq.output_ids)
            if n > a:
                loop.call_soon_threadsafe(out.put_nowait, (seq.output_ids[a:n], seq.output_logprobs[a:n]))
        stop = [k for k, _, left in streams if left.is_set() and k not in stopped]
        stopped.update(stop)
        return stop

    return on_step


def load_custom_generate(path: str) -> Callable[..., Awaitable]:
    fn = load_function(path, FLAG)
    if not inspect.iscoroutinefunction(fn):
        raise CustomGenerateError(
            f"{FLAG} {path!r}: must be an async function "
            "`async def fn(args, sample, sampling_params) -> Sample | list[Sample]`"
        )
    return fn


def run_custom_generate(
    fn: Callable[..., Awaitable], args: Any, samples: list[Sample], params: list[dict], *, engine: Any, tokenizer: Any
) -> list[Any]:
    """fn(args, sample, params) for every sample, all at once; returns what each call returned."""
    is_async = hasattr(engine, "agenerate")  # RemoteEngines, or an async engine of the caller's
    remote = is_async and hasattr(engine, "run")  # runs coroutines on its own event loop
    ctx = GenerateContext(args, tokenizer, engine if is_async else BatchingEngine(engine))

    async def run_all() -> list[Any]:
        _CONTEXT.set(ctx)  # the tasks created below copy this context
        return await gather_or_cancel(fn(args, s, p) for s, p in zip(samples, params))

    if remote:
        return engine.run(run_all())
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_all())
    # called from inside a running event loop (an async caller): run on a private loop in a thread
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = asyncio.run(run_all())
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    t = threading.Thread(target=target, name="lichen-custom-generate")
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def build_custom_samples(
    ctx: Any, prompts: list, sampling: Any, *, seed_key: int, encode: Callable[[int, Any], list[int]]
) -> list[list[Sample]]:
    """lichen.rollout.samples.build_samples with the custom generate function making each sample (`ctx`: the
    rollout's RolloutContext, `sampling`: a SamplingConfig)."""
    fn = load_custom_generate(ctx.config.custom_generate_function_path)
    n = sampling.n_samples_per_prompt
    samples, params = [], []
    for pos, (data_index, record) in enumerate(prompts):
        ids = list(encode(data_index, record))
        for j in range(n):
            samples.append(
                Sample(
                    prompt=record.prompt,
                    tokens=list(ids),
                    label=record.label,
                    status=Status.PENDING,
                    metadata={**(record.metadata or {}), "prompt_index": data_index},
                    group_index=pos,
                    index=pos * n + j,
                )
            )
            # the same per-sample budget as lichen's own requests
            budget = sampling.response_budget(len(ids), sampling.max_response_len)
            params.append(
                {
                    "max_new_tokens": budget,
                    "temperature": sampling.temperature,
                    "top_p": sampling.top_p,
                    "top_k": sampling.top_k,
                    "stop_token_ids": list(sampling.stop_token_ids),
                    "sampling_seed": derive_seed(sampling.seed, seed_key, pos, j),
                }
            )
    outputs = run_custom_generate(fn, ctx.args, samples, params, engine=ctx.engine, tokenizer=ctx.tokenizer)
    groups: list[list[Sample]] = [[] for _ in prompts]
    renumber = False
    for given, out in zip(samples, outputs):
        got = out if isinstance(out, list) else [out]
        renumber |= isinstance(out, list)
        if not got:
            raise CustomGenerateError(f"{FLAG}: returned an empty list for sample {given.index}")
        for s in got:
            _check_sample(s, given.index, ctx.tokenizer)
            s.group_index = given.group_index
            groups[given.group_index].append(s)
    if renumber:
        k = 0
        for group in groups:
            for s in group:
                s.index, k = k, k + 1
    return groups


def _check_sample(s: Any, index: int, tokenizer: Any) -> None:
    """The returned sample must be complete and consistent; fill the defaults the contract allows."""
    where = f"{FLAG}: the sample returned for index {index}"
    if not isinstance(s, Sample):
        raise CustomGenerateError(f"{where} is a {type(s).__name__}, not a lichen.types.Sample")
    if s.status == Status.PENDING:
        raise CustomGenerateError(f"{where} still has status pending; set completed, truncated, aborted or failed")
    r = s.response_length
    if not 0 <= r <= len(s.tokens):
        raise CustomGenerateError(f"{where} has response_length {r} but {len(s.tokens)} tokens")
    if s.loss_mask is None:
        s.loss_mask = [1] * r
    for name in ("loss_mask", "rollout_log_probs"):
        value = getattr(s, name)
        if value is not None and len(value) != r:
            raise CustomGenerateError(f"{where} has {len(value)} {name} entries for {r} response tokens")
    if any(m not in (0, 1) for m in s.loss_mask):
        raise CustomGenerateError(f"{where} has loss_mask values other than 0 and 1")
    if r and not s.response:
        s.response = tokenizer.decode(s.response_tokens, skip_special_tokens=True)
