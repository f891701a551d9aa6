"""Engine servers behind the in-process engine's interface: `RemoteEngines.generate(requests) -> results`.

The rollout code calls `generate(list[GenRequest]) -> list[GenResult]` the same way for the in-process `Engine`
and for N servers (lichen serve or SGLang, launched by lichen or given by address). Each request becomes one
`/generate` call (docs/architecture.md#generate-requests) routed by `Router` (least outstanding requests, sticky
sessions) and capped
per engine by `--sglang-server-concurrency`; results come back in request order. The HTTP side runs on an
event loop in a background thread, so callers stay synchronous; async code (custom generate functions) may
run coroutines on that loop with `run()` and use `agenerate` (or `agenerate_stream`: the output as it grows).

Control calls go to every engine in rotation, in parallel:
- `update_weights_from_disk(path, version)`: pause_generation -> flush_cache (until 200) ->
  update_weights_from_disk {model_path, weight_version} -> /model_info must report `version` ->
  continue_generation (also after a failure; docs/architecture.md#weight-update-sequence). A failed update leaves the
  engine serving
  its old weights and raises.
- `offload()`: flush_cache -> release_memory_occupation {} (all memory); `onload(tags)`:
  resume_memory_occupation {"tags": ...}; resuming "kv_cache" also resumes "cuda_graph", as SGLang expects
  (docs/architecture.md#weight-update-sequence).
- `weight_version`: the version every engine reports in /model_info (None when they disagree).
- `pause_generation(mode)` / `continue_generation()`: every engine in rotation.

Fault tolerance (`failover=True` and `start_health_monitor`, lichen.engines.clients.health): an engine that dies or hangs
leaves rotation, the requests it held go to the others, a launched one is restarted, and the next weight sync
(which first waits for restarts in progress) brings it to the current version and back into rotation. Control
calls then tolerate an unreachable engine (it is taken out like a failed one) as long as one engine answers;
the health probes are suspended while the engines are paused, syncing weights or offloaded.

`RemoteEngines.from_config(cfg)` takes an EngineConfig (lichen.config.engine_config, resolved from the flags
once): it launches `cfg.num_engines` servers (stopped by `close()`) or
connects to `cfg.addresses`, waits for them, and checks that each routes the endpoints `cfg.required` names.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import threading
import uuid
import weakref
from typing import TYPE_CHECKING, Any, AsyncIterator, Coroutine, Sequence

from lichen.aio import gather_or_cancel
from lichen.engines.clients import engine_debug
from lichen.engines.clients.client import (
    EngineClient,
    EngineError,
    EngineRequestError,
    EngineUnavailable,
    generate_payload,
    result_from_output,
)
from lichen.engines.clients.router import Router
from lichen.engines.core.engine import GenRequest, GenResult
from lichen.errors import ConfigError
from lichen.observe.metrics import get_logger

if TYPE_CHECKING:
    from lichen.config.engine_config import EngineConfig

log = get_logger(__name__)

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def _close_if_alive(ref: "weakref.ref[RemoteEngines]") -> None:
    engines = ref()
    if engines is not None:
        engines.close()


class RemoteEngines:
    """N engine servers as one engine. `launcher` (an EngineLauncher), when given, is stopped by `close()`."""

    is_remote = True

    def __init__(
        self,
        urls: Sequence[str],
        *,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        concurrency: int = 512,
        max_retries: int = 3,
        retry_delay: float = 0.5,
        failover: bool = False,
        launcher: Any = None,
        request_timeout: float | None = None,
        client_cls: type[EngineClient] = EngineClient,
    ):
        if not urls:
            raise ValueError("RemoteEngines needs at least one engine URL")
        self.launcher = launcher
        # the keys of engines a launcher started (it made them for this run) unless given
        api_key = api_key or getattr(launcher, "api_key", None)
        admin_api_key = admin_api_key or getattr(launcher, "admin_api_key", None)
        self._client_args: dict[str, Any] = dict(
            api_key=api_key,
            admin_api_key=admin_api_key,
            concurrency=concurrency,
            max_retries=max_retries,
            retry_delay=retry_delay,
            request_timeout=request_timeout,
        )
        self._client_cls = (
            client_cls  # the protocol adapter: EngineClient, or VLLMClient (lichen.engines.clients.vllm_client)
        )
        self.router = Router([client_cls(u, **self._client_args) for u in urls], failover=failover)
        self.released: set[str] = set()
        self.monitor: Any = None  # a HealthMonitor once start_health_monitor() ran
        self.last_weights: tuple[str, str] | None = None  # (path, version) of the last update from disk
        self.synced = False  # a weight sync has begun: engines joining later need the synced weights
        self._paused = False
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="lichen-remote-engines", daemon=True)
        self._thread.start()
        # Closed at exit even if the owner never calls close(): connections closed, launched servers stopped.
        atexit.register(_close_if_alive, weakref.ref(self))

    def __repr__(self) -> str:
        return f"RemoteEngines({self.urls})"

    @property
    def clients(self) -> list[EngineClient]:
        """Every engine of the pool (the router's list: engines added during the run included)."""
        return self.router.clients

    def make_client(self, url: str, api_key: str | None = None, admin_api_key: str | None = None) -> EngineClient:
        """A client for an engine added to the pool, with the run's settings (and keys, unless given)."""
        given = {k: v for k, v in (("api_key", api_key), ("admin_api_key", admin_api_key)) if v is not None}
        return self._client_cls(url, **{**self._client_args, **given})

    @property
    def urls(self) -> list[str]:
        return [c.url for c in self.clients]

    def _active(self) -> list[EngineClient]:
        return [self.clients[i] for i in self.router.in_rotation()]

    # ---- running coroutines -------------------------------------------------------------------------------
    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        """Run `coro` on the engines' event loop and wait for it (an interrupt cancels it there too)."""
        if self._closed or threading.current_thread() is self._thread:
            if asyncio.iscoroutine(coro):
                coro.close()  # never scheduled: close it so Python does not warn that it was never awaited
            if self._closed:
                raise EngineError("these engines are closed")
            raise RuntimeError(
                "RemoteEngines.run/generate called on the engines' own event loop (it would wait "
                "for itself); await agenerate(...) there instead"
            )
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except BaseException:
            fut.cancel()
            raise

    async def _each(self, fn, clients: list[EngineClient] | None = None, *, tolerant: bool | None = None) -> list:
        """fn(client) on every engine in rotation at once; if any fails, raise naming every failure.

        `tolerant` (default: with failover): an engine that cannot be reached is taken out of rotation like a
        failed one and its result is None, unless no engine answered at all."""
        clients = self._active() if clients is None else clients
        tolerant = self.router.failover if tolerant is None else tolerant
        results = await asyncio.gather(*[fn(c) for c in clients], return_exceptions=True)
        errors = [(c, r) for c, r in zip(clients, results) if isinstance(r, BaseException)]
        if tolerant and len(errors) < len(clients):
            lost = [(c, r) for c, r in errors if isinstance(r, EngineUnavailable)]
            for c, r in lost:
                self.engine_failed(self.clients.index(c), str(r))
            errors = [(c, r) for c, r in errors if not isinstance(r, EngineUnavailable)]
            results = [None if isinstance(r, EngineUnavailable) else r for r in results]
        if errors:
            if len(errors) == 1:
                raise errors[0][1]
            raise EngineError("; ".join(str(r) if str(r).startswith(c.url) else f"{c.url}: {r}" for c, r in errors))
        return results

    def debug_stacks(self, timeout: float = 10.0) -> dict[str, str]:
        """{url: every thread's stack} of each server (`GET /debug/stacks`), or why it gave none (hang watchdog)."""
        return engine_debug.stacks(self, timeout)

    def debug_trace(self, since: float, timeout: float = 10.0) -> dict[str, dict]:
        """{url: its `GET /debug/trace?since=` answer} of the servers that gave one (lichen serve), for --trace."""
        return engine_debug.trace(self, since, timeout)

    def engine_failed(self, index: int, reason: str) -> None:
        """Engine `index` is dead or hung (on the engines' loop): out of rotation, its requests re-sent, and
        the health monitor (if any) restarts it."""
        if index in self.router.active:
            self.router.fail(index, reason)  # tells the monitor through router.on_down
        elif self.monitor is not None:
            self.monitor.on_down(index, reason)

    @contextlib.asynccontextmanager
    async def _probes_suspended(self):
        if self.monitor is not None:
            self.monitor.suspend()
        try:
            yield
        finally:
            if self.monitor is not None:
                self.monitor.resume()

    # ---- generation ---------------------------------------------------------------------------------------
    def generate(
        self, requests: list[GenRequest], session_ids: Sequence[str | None] | None = None, *, allow_abort: bool = False
    ) -> list[GenResult]:
        """Results in request order. An aborted request raises EngineError unless `allow_abort`."""
        if not requests:
            return []
        if session_ids is not None and len(session_ids) != len(requests):
            raise ValueError(f"{len(session_ids)} session ids for {len(requests)} requests")
        return self.run(self._generate_all(requests, session_ids, allow_abort))

    async def _generate_all(self, requests, session_ids, allow_abort) -> list[GenResult]:
        sids = session_ids if session_ids is not None else [None] * len(requests)
        return await gather_or_cancel(self.agenerate(r, s, allow_abort=allow_abort) for r, s in zip(requests, sids))

    async def agenerate(
        self, request: GenRequest, session_id: str | None = None, *, rid: str | None = None, allow_abort: bool = False
    ) -> GenResult:
        """One request, on the engines' loop (see `run`)."""
        index, out = await self.router.generate(generate_payload(request, rid=rid or uuid.uuid4().hex), session_id)
        return self._result(index, out, allow_abort)

    async def agenerate_stream(
        self, request: GenRequest, session_id: str | None = None, *, rid: str | None = None
    ) -> AsyncIterator[GenResult]:
        """`agenerate` as it grows (the agent proxy streams it): GenResults of the output so far with finish_reason
        None, then the final one. Not re-sent on failover (Router.generate_stream)."""
        payload = generate_payload(request, rid=rid or uuid.uuid4().hex)
        async with contextlib.aclosing(self.router.generate_stream(payload, session_id)) as events:
            async for index, out in events:
                result = self._result(index, out)
                if out["meta_info"].get("finish_reason") is None:  # not the last event: the output so far
                    result.finish_reason = None
                yield result

    def _result(self, index: int, out: dict, allow_abort: bool = False) -> GenResult:
        """The GenResult of engine `index`'s /generate output; an aborted request raises EngineError unless
        `allow_abort`."""
        url = self.clients[index].url
        result = result_from_output(out, url)
        result.engine = url
        if result.finish_reason == "abort" and not allow_abort:
            reason = out["meta_info"].get("finish_reason") or {}
            raise EngineError(f"{url} aborted a rollout request: {reason.get('message', reason)}")
        return result

    # ---- state and control --------------------------------------------------------------------------------
    def weight_versions(self) -> list[str | None]:
        """The version each engine in rotation reports (an engine lost meanwhile is left out)."""

        async def get() -> list[str | None]:
            clients = self._active()
            versions = await self._each(lambda c: c.weight_version(), clients)
            return [v for c, v in zip(clients, versions) if self.clients.index(c) in self.router.active]

        return self.run(get())

    @property
    def weight_version(self) -> str | None:
        """The version all engines in rotation report, or None when they disagree."""
        versions = set(self.weight_versions())
        return versions.pop() if len(versions) == 1 else None

    def update_weights_from_disk(self, path: str, version: str) -> None:
        """Every engine loads the HF checkpoint at `path` (readable by the servers) as weight version `version`.

        With a health monitor, restarts in progress are waited for first, and engines waiting to re-join
        (restarted, or answering again) load it too and return to rotation."""
        self.run(self._update_all(path, str(version)))

    async def _update_all(self, path: str, version: str) -> None:
        async with self._probes_suspended():
            self.synced = True
            if self.monitor is not None:
                await self.monitor.settle()
            joining = self.monitor.pending() if self.monitor is not None else []
            await self._each(lambda c: self._update_one(c, path, version))
            self.last_weights = (path, version)
            for index in joining:
                try:
                    await self.monitor.join(index, catch_up=True)
                except Exception as e:  # noqa: BLE001 - it stays out; the engines in rotation are up to date
                    log.error(
                        "engine %s could not load weight version %s to re-join: %s", self.clients[index].url, version, e
                    )
                    self.monitor.on_down(index, f"weight update failed: {e}")

    async def _update_one(self, c: EngineClient, path: str, version: str) -> None:
        await c.call_json("POST", "/pause_generation", {})
        failure: BaseException | None = None
        try:
            await c.flush_cache()
            status, body = await c.request(
                "POST",
                "/update_weights_from_disk",
                {"model_path": path, "weight_version": version, "abort_all_requests": False},
            )
            if status != 200 or not (isinstance(body, dict) and body.get("success")):
                raise EngineRequestError(c.url, "/update_weights_from_disk", status, body)
            got = await c.weight_version()
            if got != version:
                raise EngineError(f"{c.url} reports weight version {got!r} after loading {path!r} as {version!r}")
        except BaseException as e:
            failure = e
            raise
        finally:
            try:
                await c.call_json("POST", "/continue_generation", {})
            except Exception as e:  # do not hide the update's own error behind this one
                if failure is None:
                    raise
                log.error("%s/continue_generation failed after a failed update: %s", c.url, e)

    def flush_cache(self) -> None:
        self.run(self._each(lambda c: c.flush_cache()))

    def pause_generation(self, mode: str = "abort") -> None:
        """POST /pause_generation {mode} to every engine; health probes stay suspended until
        `continue_generation()` (a paused engine does not answer /health_generate)."""

        async def pause() -> None:
            if self.monitor is not None and not self._paused:
                self.monitor.suspend()
            self._paused = True
            await self._each(lambda c: c.call_json("POST", "/pause_generation", {"mode": mode}))

        self.run(pause())

    def continue_generation(self) -> None:
        async def cont() -> None:
            try:
                await self._each(lambda c: c.call_json("POST", "/continue_generation", {}))
            finally:
                if self.monitor is not None and self._paused:
                    self.monitor.resume()
                self._paused = False

        self.run(cont())

    def admit_restarted(self) -> list[int]:
        """For a transport that brings every engine in rotation to the new version itself (the broadcast): wait
        for restarts in progress and put restarted engines back into rotation before the sync reaches them
        (update_weights_from_disk does this itself). Returns their indices."""

        async def admit() -> list[int]:
            async with self._probes_suspended():
                await self.monitor.settle()
                joining = self.monitor.pending()
                for index in joining:
                    await self.monitor.join(index, catch_up=False)
                return joining

        self.synced = True
        return self.run(admit()) if self.monitor is not None else []

    def start_health_monitor(self, *, interval: float, timeout: float, first_wait: float, pool: Any = None) -> Any:
        """Watch the engines (lichen.engines.clients.health.watch); needs `failover`. `pool`: keyword arguments of an
        EnginePool (lichen.engines.clients.pool: retiring, the floor, engines added). Returns the HealthMonitor."""
        from lichen.engines.clients.health import watch

        self.monitor = watch(self, interval=interval, timeout=timeout, first_wait=first_wait, pool=pool)
        return self.monitor

    def abort_all(self) -> None:
        async def abort() -> None:
            async with self._probes_suspended():  # it would also abort a health probe in flight: not a failure
                await self._each(lambda c: c.call_json("POST", "/abort_request", {"abort_all": True}))

        self.run(abort())

    def offload(self) -> None:
        """Release weights and KV cache on every engine (a no-op on CPU servers, but the call sequence is real)."""
        if self.released:
            return

        async def release(c: EngineClient) -> None:
            await c.flush_cache()
            await c.call_json("POST", "/release_memory_occupation", {})

        async def release_all() -> None:
            async with self._probes_suspended():
                await self._each(release)
                self.released = set(MEMORY_TAGS)  # probes stay suspended while anything is released

        self.run(release_all())

    def onload(self, tags: list[str] | None = None) -> None:
        want = set(MEMORY_TAGS) if tags is None else set(tags)
        if "kv_cache" in want:
            want.add("cuda_graph")
        todo = [t for t in MEMORY_TAGS if t in want and t in self.released]
        if not todo:
            return

        async def resume() -> None:
            async with self._probes_suspended():
                await self._each(lambda c: c.call_json("POST", "/resume_memory_occupation", {"tags": todo}))
                self.released.difference_update(todo)

        self.run(resume())

    # ---- weight transports (driven by lichen.sync) ----------------------------------------------------------
    def submit(self, coro: Coroutine[Any, Any, Any]) -> "concurrent.futures.Future[Any]":
        """Start `coro` on the engines' loop and return a concurrent Future at once: for HTTP calls that must be
        in flight while the caller's thread does its part (a torch.distributed broadcast)."""
        if self._closed:
            if asyncio.iscoroutine(coro):
                coro.close()
            raise EngineError("these engines are closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _post_ok(self, c: EngineClient, path: str, body: dict, timeout: float | None = None) -> dict:
        """POST an SGLang weight call; anything but 200 with `"success": true` raises EngineRequestError."""
        status, out = await c.request("POST", path, body, timeout=timeout, retry=False)
        if status != 200 or not (isinstance(out, dict) and out.get("success", True) is not False):
            raise EngineRequestError(c.url, path, status, out)
        return out

    def active_urls(self) -> list[str]:
        """The engines in rotation (the ones control calls and weight syncs reach)."""
        return [c.url for c in self._active()]

    def server_infos(self) -> list[dict]:
        """Each engine in rotation's `/server_info`. With failover, an engine that cannot be reached leaves rotation
        (`_each`) and gives no entry: the list is the engines still in rotation, which the sync then reaches."""
        infos = self.run(self._each(lambda c: c.call_json("GET", "/server_info")))
        return [i for i in infos if i is not None]

    def paused(self):
        """Context manager: every engine in rotation paused and flushed inside; continued on exit, also after a
        failure (docs/architecture.md#weight-update-sequence). Used for transports that must reach all engines at
        once."""
        import contextlib

        @contextlib.contextmanager
        def scope():
            self.pause_generation()  # also suspends the health probes (a paused engine does not answer them)
            try:
                self.flush_cache()
                yield self
            finally:
                self.continue_generation()

        return scope()

    def post_each(self, path: str, body: dict | Sequence[dict], *, timeout: float | None = None, wait: bool = True):
        """POST an SGLang weight call to every engine in rotation (`body`, or body i to engine i) and return the
        answers; each must be 200 with `"success": true` (else EngineRequestError). With `wait=False`, return a
        concurrent Future at once: /init_weights_update_group and /update_weights_from_distributed answer only
        once the caller's side of the torch.distributed call has run."""
        clients = self._active()
        bodies = [body] * len(clients) if isinstance(body, dict) else list(body)
        if len(bodies) != len(clients):
            raise ValueError(f"{len(bodies)} bodies for {len(clients)} engines")
        by_url = {c.url: b for c, b in zip(clients, bodies)}
        if wait:
            return self.run(self._each(lambda c: self._post_ok(c, path, by_url[c.url], timeout), clients))

        async def fail_fast() -> list[dict]:
            # The first error ends the wait: the other engines may be blocked in a collective that can no longer
            # complete without the one that failed.
            tasks = [asyncio.ensure_future(self._post_ok(c, path, by_url[c.url], timeout)) for c in clients]
            done, rest = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failed = [t for t in done if t.exception() is not None]
            if failed:
                for t in rest:
                    t.cancel()
                error = failed[0].exception()
                assert error is not None  # the failed ones
                raise error
            return [t.result() for t in tasks]

        return self.submit(fail_fast())

    def destroy_weights_update_group(self, group_name: str) -> None:
        """Leave the group on every engine in rotation; an engine that does not know it is fine (as slime)."""

        async def destroy(c: EngineClient) -> None:
            await c.request("POST", "/destroy_weights_update_group", {"group_name": group_name}, retry=False)

        self.run(self._each(destroy))

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        """The first `truncate_size` rows of parameter `name` (nested float lists), from each engine in rotation
        (None for one that could not be reached: it left rotation)."""
        body = {"name": name, "truncate_size": int(truncate_size)}
        return self.run(self._each(lambda c: c.call_json("POST", "/get_weights_by_name", body)))

    # ---- start-up checks ----------------------------------------------------------------------------------
    def wait_healthy(self, timeout: float = 120.0, *, reachable: bool = False) -> None:
        """Every engine answers /health with 200 (see EngineClient.wait_healthy for `reachable`)."""
        self.run(self._each(lambda c: c.wait_healthy(timeout, reachable=reachable), tolerant=False))

    def missing_endpoints(self, paths: Sequence[str]) -> dict[str, list[str]]:
        """url -> the paths of `paths` that engine does not route."""

        async def probe(c: EngineClient) -> list[str]:
            found = await asyncio.gather(*[c.has_endpoint(p) for p in paths])
            return [p for p, ok in zip(paths, found) if not ok]

        missing = self.run(self._each(probe, tolerant=False))
        return {c.url: m for c, m in zip(self._active(), missing) if m}

    def require_endpoints(self, needed: dict[str, str]) -> None:
        """Raise ConfigError naming every engine that lacks an endpoint of `needed` (path -> what needs it)."""
        missing = self.missing_endpoints(list(needed))
        if missing:
            parts = [
                f"{url} lacks " + ", ".join(f"{p} (needed by {needed[p]})" for p in paths)
                for url, paths in missing.items()
            ]
            raise ConfigError(
                "engine server endpoints missing: " + "; ".join(parts) + ". Use lichen serve or an "
                "SGLang release that has them"
            )

    # ---- construction from an EngineConfig -----------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: EngineConfig, launcher: Any = None) -> "RemoteEngines":
        """Launch `cfg.num_engines` servers (or connect to `cfg.addresses`), wait until they answer, check that
        each routes `cfg.required`, and start the health monitor with `cfg.failover` (lichen.engines.clients.connect).
        `launcher`: servers started elsewhere (the Ray runtime's engine actors) with the launcher interface."""
        from lichen.engines.clients.connect import connect

        return connect(cfg, launcher)

    # ---- shutdown -----------------------------------------------------------------------------------------
    async def _aclose(self) -> None:
        if self.monitor is not None:
            await self.monitor.stop()  # before the launcher stops: no restart may outlive close()
        me = asyncio.current_task()
        others = [t for t in asyncio.all_tasks() if t is not me]
        for t in others:
            t.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        await self.router.close()

    def close(self) -> None:
        """Cancel what is in flight, close the connections, stop launched servers. Idempotent."""
        if self._closed:
            return
        try:
            if self._thread.is_alive():
                try:
                    asyncio.run_coroutine_threadsafe(self._aclose(), self._loop).result(10.0)
                except Exception as e:
                    log.warning("closing engine connections: %s", e)
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(10.0)
            if not self._thread.is_alive():
                self._loop.close()
        finally:
            self._closed = True
            if self.launcher is not None:
                self.launcher.stop()

    def __enter__(self) -> "RemoteEngines":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
