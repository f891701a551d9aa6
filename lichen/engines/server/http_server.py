"""The HTTP side of `lichen serve`: SGLang's native endpoints (docs/architecture.md#engine-protocol) over aiohttp.

The event loop owns the request registry (rid -> job) and the pause gate; the scheduler thread owns the engine.
Jobs go to the scheduler after the gate; results come back through `_on_events`, which hops onto the loop.
A request that arrives while generation is paused waits at the gate (docs/architecture.md#pause-semantics) and never
reaches the
scheduler until `/continue_generation`; `/abort_request` still answers it at once.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, TypeVar

from aiohttp import web

from lichen.engines.api.auth import key_for_path, request_has_key
from lichen.engines.api.protocol import (
    Facts,
    Job,
    OutputOptions,
    RequestError,
    Sampling,
    error_body,
    expect,
    loads,
    make_job,
    parse_generate,
)
from lichen.engines.core.engine import Engine
from lichen.engines.server import info_endpoints, openai_api, tensor_update, weight_endpoints
from lichen.engines.server.limits import (
    BodyRefused,
    Limits,
    Overloaded,
    free_memory_bytes,
    job_tokens,
    longest_token_chars,
    read_body,
    torch_itemsize,
)
from lichen.engines.server.responses import Detok, LockedTokenizer, abort_status, generate_output
from lichen.engines.server.scheduler import MEMORY_TAGS, Scheduler, SchedulerError
from lichen.engines.server.weight_paths import WeightDirs
from lichen.excerpt import clip, json_excerpt
from lichen.observe.metrics import get_logger
from lichen.observe.trace import trace_payload
from lichen.observe.watchdog import thread_stacks

log = get_logger(__name__)

# Generation: a client that goes away aborts its request (and frees its rid); every other call runs to its end.
CANCELLABLE_PATHS = frozenset({"/generate", "/health_generate", "/v1/completions", "/v1/chat/completions"})
FLUSH_OK = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
    "requests, the operation will not be performed.)\n"
)
T = TypeVar("T")


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(obj).encode(), status=status, content_type="application/json")


class LichenServer:
    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        *,
        model_path: str,
        served_model_name: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        max_running: int = 256,
        context_length: int | None = None,
        health_timeout: float = 20.0,
        architectures: list[str] | None = None,
        limits: Limits | None = None,
        weight_dirs: WeightDirs | None = None,
        tool_parser: Any = None,
    ):
        cfg = engine.model.cfg
        tokenizer = LockedTokenizer(tokenizer)
        self.engine = engine
        self.model_path = self.tokenizer_path = model_path
        self.served_model_name = served_model_name or model_path
        self.limits = limits or Limits()
        self.weight_dirs = weight_dirs or WeightDirs(model_path)  # where weight requests may read and write
        self.queued_tokens = 0  # prompt + max_new_tokens of every registered job (the queue bound counts them)
        self.host, self.port = host, port
        self.api_key, self.admin_api_key = api_key, admin_api_key
        self.health_timeout = health_timeout
        self.tool_parser = tool_parser  # lichen.engines.api.tool_parsers; None: requests with tools are refused
        self.architectures = architectures or []
        ctx = context_length or cfg.max_position_embeddings
        longest = longest_token_chars(tokenizer)
        self.facts = Facts(
            tokenizer,
            cfg.vocab_size,
            ctx,
            list(engine.eos_token_ids),
            max_request_sequences=self.limits.max_request_sequences,
            # a text of more characters than this has more tokens than the context holds (limits.longest_token_chars)
            max_text_chars=None if longest is None else ctx * longest,
        )
        # JSON decoding, templating and tokenizing of requests: off the event loop (which must keep answering
        # /health and the control calls), in their own threads so weight updates never queue behind them
        self._parse_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lichen-parse")
        self.refused: Counter[str] = Counter()  # answered errors by HTTP status, for /metrics
        self.detok = Detok(tokenizer)
        self.scheduler = Scheduler(
            engine, max_running=max_running, on_events=self._on_events, stop_text=self.detok.stop_text
        )
        self.jobs: dict[str, Job] = {}
        self.paused = False
        self.started = time.time()
        self.peaks_reset = False  # whether /reset_peak_memory reset the peak RSS counter (info_endpoints)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._resumed: asyncio.Event | None = None
        self._rate = (time.monotonic(), 0, 0.0)  # (when, tokens then, last throughput) for /v1/loads

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.scheduler.start()

    async def stop(self) -> None:
        """Answer everything in flight (partial output, finish_reason abort), also requests held by a pause."""
        if self.scheduler.alive():
            await self.abort_jobs(list(self.jobs.values()), "server is shutting down")
        await asyncio.to_thread(self.scheduler.stop)
        self._parse_pool.shutdown(wait=False, cancel_futures=True)

    async def offload(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run CPU-heavy request parsing `fn(*args, **kwargs)` in the parse threads, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(
            self._parse_pool, functools.partial(fn, *args, **kwargs)
        )

    # ---- jobs ---------------------------------------------------------------------------------------------
    def _on_events(self, progress: list, done: list) -> None:  # scheduler thread
        self.loop.call_soon_threadsafe(self._dispatch, progress, done)

    def _dispatch(self, progress: list, done: list) -> None:
        for seq, n in progress:
            job = seq.tag
            if job is not None and job.queue is not None and not job.done.done():
                job.queue.put_nowait((job, n))
        for seq in done:
            job = seq.tag
            if job is None or job.done.done():
                continue
            job.done.set_result(None)
            if job.queue is not None:
                job.queue.put_nowait((job, None))

    def _register(self, jobs: list[Job], *, bounded: bool = True) -> None:
        clash = [j.rid for j in jobs if j.rid in self.jobs]
        if clash:
            raise RequestError(f"request id(s) {json_excerpt(clash)} are already in flight; send unique rids")
        tokens = sum(job_tokens(j) for j in jobs)
        if bounded:
            self.limits.admit(len(jobs), tokens, len(self.jobs), self.queued_tokens)
        for j in jobs:
            j.done = self.loop.create_future()
            self.jobs[j.rid] = j
        self.queued_tokens += tokens

    def _unregister(self, jobs: list[Job]) -> None:
        for j in jobs:
            if self.jobs.get(j.rid) is j:
                del self.jobs[j.rid]
                self.queued_tokens -= job_tokens(j)

    async def _admit(self, jobs: list[Job]) -> None:
        """Wait at the pause gate (answered early if all are aborted meanwhile), then hand over."""
        while self.paused:
            pending = [j.done for j in jobs if not j.done.done()]
            if not pending:
                return
            resumed = asyncio.ensure_future(self._resumed.wait())
            try:
                await asyncio.wait([resumed, *pending], return_when=asyncio.FIRST_COMPLETED)
            finally:
                resumed.cancel()
        if not self.scheduler.alive():
            raise RequestError("the server is shutting down", status=503, shape="object")
        todo = [j for j in jobs if not j.done.done()]
        for j in todo:
            j.submitted = True
        if todo:
            self.scheduler.submit([j.seq for j in todo])

    async def run_jobs(self, jobs: list[Job], *, bounded: bool = True) -> None:
        """Generate for `jobs` and wait for all of them (aborted ones come back with their partial output).
        Cancelled (the client disconnected: handler_cancellation), it aborts them and frees their rids."""
        self._register(jobs, bounded=bounded)
        try:
            await self._admit(jobs)
            # asyncio.wait, not gather: a cancelled gather cancels the futures, and abort_jobs would then take
            # the jobs for finished and leave them running
            if jobs:
                await asyncio.wait([j.done for j in jobs])
        except asyncio.CancelledError:
            await asyncio.shield(self.abort_jobs(jobs, "request cancelled"))
            raise
        finally:
            self._unregister(jobs)

    async def stream_jobs(self, jobs: list[Job]) -> AsyncIterator[tuple[Job, int | None]]:
        """Yield (job, n_tokens) while jobs generate and (job, None) once each is done. Closing the iterator
        early (the client went away) aborts what is still running."""
        queue: asyncio.Queue = asyncio.Queue()
        for j in jobs:
            j.queue = queue
        self._register(jobs)
        try:
            await self._admit(jobs)
            left = len(jobs)
            while left:
                job, n = await queue.get()
                if n is None:
                    left -= 1
                elif job.done.done():
                    continue
                yield job, n
        finally:
            await asyncio.shield(self.abort_jobs(jobs, "client disconnected"))
            self._unregister(jobs)

    async def abort_jobs(self, jobs: list[Job], message: str) -> None:
        version = self.engine.weight_version
        for j in jobs:
            if not j.submitted and j.done is not None and not j.done.done():
                j.seq.finish, j.seq.finish_version = ("abort", "Abort in waiting queue", None), version
                self._dispatch([], [j.seq])
        seqs = [j.seq for j in jobs if j.submitted and not j.done.done()]
        if seqs and self.scheduler.alive():
            await asyncio.wrap_future(self.scheduler.call(lambda s: s.abort(seqs, message)))

    async def control(self, fn, *, exclusive: bool = False) -> Any:
        return await asyncio.wrap_future(self.scheduler.call(fn, exclusive=exclusive))

    # ---- app ----------------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        middlewares = [self._errors, self._auth, self._bounded_body, self._shield]
        if getattr(self.engine.model, "is_hf", False):  # the generic HF path refuses what it has not been tested with
            from lichen.engines.server.hf_serve import refuse_untested

            middlewares.append(refuse_untested)
        app = web.Application(middlewares=middlewares, client_max_size=self.limits.max_request_bytes)
        r = app.router
        for method in ("POST", "PUT"):
            r.add_route(method, "/generate", self.generate)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        info_endpoints.add_routes(app, self)  # /model_info, /get_server_info, /v1/loads, /ready, /metrics, ...
        for method in ("GET", "POST"):
            r.add_route(method, "/flush_cache", self.flush_cache)
            r.add_route(method, "/get_weights_by_name", self.get_weights_by_name)
            r.add_route(method, "/release_memory_occupation", self.release_memory)
            r.add_route(method, "/resume_memory_occupation", self.resume_memory)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_get("/debug/stacks", self.debug_stacks)  # for the trainer's hang watchdog (lichen.observe.watchdog)
        r.add_get("/debug/trace", self.debug_trace)  # for the trainer's --trace (lichen.observe.trace)
        openai_api.add_routes(app, self)
        weight_endpoints.add_routes(app, self)  # also /update_weights_from_disk, which can apply deltas live
        tensor_update.add_routes(app, self)  # /update_weights_from_tensor: handles to a colocated trainer's memory
        return app

    async def debug_stacks(self, request: web.Request) -> web.Response:
        """Every thread's stack of this server as text; answered on the event loop, so a stuck scheduler thread
        shows where it is stuck."""
        return web.Response(text=thread_stacks(), content_type="text/plain")

    async def debug_trace(self, request: web.Request) -> web.Response:
        """This server's finished phases (busy periods of the scheduler, weight updates) that ended after
        `?since=` (seconds since the epoch), with its pid and clock, for the trainer's trace."""
        try:
            since = float(request.query.get("since", 0))
        except ValueError:
            raise RequestError("since must be a number of seconds since the epoch", shape="object") from None
        return json_response(trace_payload(since))

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        openai = request.path.startswith("/v1/")
        try:
            return await handler(request)
        except RequestError as e:
            self.refused[str(e.status)] += 1
            resp = json_response(error_body(e.message, e.status, "object" if openai else e.shape), e.status)
            if isinstance(e, Overloaded):
                resp.headers["Retry-After"] = "1"
            if isinstance(e, BodyRefused):  # the rest of the body is not read: this connection cannot go on
                resp.force_close()
            return resp
        except web.HTTPException as e:  # 404, 405 from aiohttp itself
            if e.status < 400:
                raise
            self.refused[str(e.status)] += 1
            return json_response(error_body(e.reason or str(e), e.status, "object"), e.status)
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as e:  # a bug must cost one request, never the server
            log.exception("unhandled error in %s %s", request.method, request.path)
            return json_response(error_body(f"internal error: {type(e).__name__}: {clip(str(e))}", 500, "object"), 500)

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        key = key_for_path(request.path, self.api_key, self.admin_api_key)
        if key is not None and not request_has_key(request.headers, key):
            return json_response({"error": "Unauthorized"}, 401)
        return await handler(request)

    @web.middleware
    async def _bounded_body(self, request: web.Request, handler) -> web.StreamResponse:
        """Every body is read here, before its handler runs: refused (413) at once when its Content-Length is
        over --max-request-bytes, cut off (413) when a body without one grows past it, and 408 when it is not
        complete within --body-timeout; handlers then read the buffered bytes."""
        if request.body_exists:
            await read_body(request, self.limits)
        return await handler(request)

    @web.middleware
    async def _shield(self, request: web.Request, handler) -> web.StreamResponse:
        """A client that disconnects cancels its handler (handler_cancellation): generation is aborted then, as
        SGLang does; a control call (weights, pause, memory) always runs to its end."""
        if request.path in CANCELLABLE_PATHS:
            return await handler(request)
        return await asyncio.shield(handler(request))

    async def _body(self, request: web.Request, empty: Any = None) -> Any:
        return await self.offload(loads, await request.read(), empty=empty)

    async def _object(self, request: web.Request) -> dict:
        return expect(await self._body(request, empty={}), (dict,), "the request body", "a JSON object")

    # ---- generation ---------------------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        jobs, single, stream = await self.offload(lambda: parse_generate(loads(raw), self.facts))
        if stream:
            return await self._stream_generate(request, jobs, single)
        await self.run_jobs(jobs)
        version = self.engine.weight_version
        for j in jobs:
            status = abort_status(j)
            if status is not None:
                return json_response(error_body(j.seq.finish[1], status, "object"), status)
        outs = [generate_output(j, self.detok, version) for j in jobs]
        return json_response(outs[0] if single else outs)

    async def _stream_generate(self, request: web.Request, jobs: list[Job], single: bool) -> web.StreamResponse:
        def chunks(job: Job | None, n: int | None) -> list[dict]:
            if job is None:
                return []  # /generate closes with [DONE] only
            out = generate_output(job, self.detok, self.engine.weight_version, n)
            if not single:
                out["index"] = job.index
            return [out]

        return await openai_api.sse_stream(request, self, jobs, chunks)

    def _probe_job(self) -> Job:
        sp = Sampling(1, 0.0, 1.0, -1, (), (), True, True, False, 1, 0)
        return make_job(f"HEALTH_CHECK_{uuid.uuid4().hex}", 0, [0], sp, 0, OutputOptions(), self.facts, "health")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.scheduler.alive() else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        """200 once a one-token generation goes through; 503 if it does not within the timeout (as when paused)."""
        if not self.scheduler.alive():
            return web.Response(status=503)
        job = self._probe_job()
        try:
            await asyncio.wait_for(self.run_jobs([job], bounded=False), self.health_timeout)
        except asyncio.TimeoutError:
            return web.Response(status=503)
        return web.Response(status=200 if abort_status(job) is None else 503)

    # ---- control ------------------------------------------------------------------------------------------
    def _flushable(self) -> bool:
        sch = self.scheduler  # retracted requests hold no cache; paused-in-place ones do
        return not sch.num_running and (not sch.num_waiting or sch.paused)

    async def flush_cache(self, request: web.Request) -> web.Response:
        try:
            timeout = float(request.query.get("timeout", 0))
        except ValueError:
            raise RequestError("timeout must be a number of seconds", shape="object") from None
        end = time.monotonic() + max(0.0, timeout)
        while not self._flushable() and time.monotonic() < end:
            await asyncio.sleep(0.01)
        if self._flushable():
            return web.Response(text=FLUSH_OK)
        sch = self.scheduler
        return web.Response(
            status=400,
            text=f"Flush cache failed: {sch.num_running} running and {sch.num_waiting} waiting request(s).\n",
        )

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await self._object(request)
        rid = body.get("rid")
        if rid is not None and not isinstance(rid, str):
            raise RequestError("rid must be a string")
        abort_all = body.get("abort_all", False)
        expect(abort_all, (bool,), "abort_all", "true or false")
        if abort_all:
            hit = list(self.jobs.values())
        elif rid:  # a prefix, so a base rid aborts all n samples of its request (as SGLang)
            hit = [j for j in self.jobs.values() if j.rid.startswith(rid)]
        else:  # no rid aborts nothing (an empty prefix would match everything)
            hit = []
        await self.abort_jobs(hit, "Abort by /abort_request")
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await self._object(request)
        mode = body.get("mode") or "abort"
        if mode not in ("abort", "retract", "in_place"):
            raise RequestError(f"mode must be 'abort', 'retract' or 'in_place', got {mode!r}")
        self.paused = True
        self._resumed.clear()
        await self.control(lambda s: s.pause(mode))
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self._object(request)
        await self.control(lambda s: s.resume())
        self.paused = False
        self._resumed.set()
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def _abort_all_if(self, body: dict, default: bool) -> None:
        flag = body.get("abort_all_requests", default)
        if expect(flag, (bool,), "abort_all_requests", "true or false"):
            await self.abort_jobs(list(self.jobs.values()), "Abort for a weight update")

    def set_model_path(self, path: str) -> None:
        """After a successful update from disk: SGLang then serves (and names) the model as the new path."""
        self.model_path = self.served_model_name = path

    def kv_capacity(self) -> int:
        """Tokens of KV cache this server can actually hold: max_running x context, or fewer when the memory
        left (plus what the cache holds now) cannot fit them."""
        eng, sch = self.engine, self.scheduler
        cfg = eng.model.cfg
        per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch_itemsize(eng.dtype)
        want = sch.max_running * self.facts.context_length
        free = free_memory_bytes(eng.device)
        if free is None or per_token <= 0:
            return want
        return min(want, sch.cache_tokens + free // per_token)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await self._object(request)
        path = body.get("model_path")
        expect(path, (str,), "model_path", "a string (the checkpoint directory)")
        real = self.weight_dirs.model(path)  # 403 for a directory this server was not started with
        version = body.get("weight_version")
        if version is not None:
            expect(version, (str,), "weight_version", "a string")
        await self._abort_all_if(body, False)
        paused = self.scheduler.num_running + self.scheduler.num_waiting if self.paused else 0
        try:
            state = await asyncio.to_thread(self.engine.read_checkpoint, real)
        except ValueError as e:  # the old weights keep serving
            return json_response(
                {"success": False, "message": f"Failed to update weights: {e}", "num_paused_requests": paused}, 400
            )

        def apply(s: Scheduler) -> None:
            s.engine.apply_state(state)
            if version is not None:
                s.engine.weight_version = version

        await self.control(apply, exclusive=True)
        self.set_model_path(path)
        msg = "Succeeded to update model weights." + (f" Weight version updated to {version}." if version else "")
        return json_response({"success": True, "message": msg, "num_paused_requests": paused})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await self._object(request)
        version = body.get("new_version")
        expect(version, (str,), "new_version", "a string")
        await self._abort_all_if(body, True)

        def setv(s: Scheduler) -> None:
            s.engine.weight_version = version

        await self.control(setv)
        return json_response(
            {"success": True, "message": f"Weight version updated to {version}", "new_version": version}
        )

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = await self._object(request)
        name = body.get("name")
        expect(name, (str,), "name", "a string (a parameter name)")
        size = body.get("truncate_size", 100)
        expect(size, (int,), "truncate_size", "an integer")

        def get(s: Scheduler) -> list:
            model = s.engine.model
            params = dict(model.named_parameters())
            if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
                return model.lm_head_weight[:size].float().cpu().tolist()
            return params[name][:size].float().cpu().tolist()

        try:
            return json_response(await self.control(get))
        except KeyError:
            raise RequestError(f"Get parameter by name failed: no parameter {name!r}") from None

    def _tags(self, body: dict) -> list[str] | None:
        tags = body.get("tags")
        if tags is None:
            return None
        expect(tags, (list,), "tags", f"a list of {list(MEMORY_TAGS)} or null")
        bad = [t for t in tags if t not in MEMORY_TAGS]
        if bad:
            raise RequestError(f"tags: unknown memory tag(s) {bad}; known: {list(MEMORY_TAGS)}")
        return tags

    async def release_memory(self, request: web.Request) -> web.Response:
        tags = self._tags(await self._object(request))
        try:
            await self.control(lambda s: s.release(tags))
        except SchedulerError as e:
            raise RequestError(str(e)) from None
        return json_response(None)

    async def resume_memory(self, request: web.Request) -> web.Response:
        tags = self._tags(await self._object(request))
        try:
            await self.control(lambda s: s.resume_memory(tags))
        except SchedulerError as e:
            raise RequestError(str(e)) from None
        return json_response(None)
