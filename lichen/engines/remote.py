"""Engine servers behind the in-process engine's interface: `RemoteEngines.generate(requests) -> results`.

The rollout code calls `generate(list[GenRequest]) -> list[GenResult]` the same way for the in-process `Engine`
and for N servers (lichen serve or SGLang, launched by lichen or given by address). Each request becomes one
`/generate` call (sglang-api.md §2) routed by `Router` (least outstanding requests, sticky sessions) and capped
per engine by `--sglang-server-concurrency`; results come back in request order. The HTTP side runs on an
event loop in a background thread, so callers stay synchronous; async code (custom generate functions) may
run coroutines on that loop with `run()` and use `agenerate`.

Control calls go to every engine in rotation, in parallel:
- `update_weights_from_disk(path, version)`: pause_generation -> flush_cache (until 200) ->
  update_weights_from_disk {model_path, weight_version} -> /model_info must report `version` ->
  continue_generation (also after a failure; sglang-api.md §7.5). A failed update leaves the engine serving
  its old weights and raises.
- `offload()`: flush_cache -> release_memory_occupation {} (all memory); `onload(tags)`:
  resume_memory_occupation {"tags": ...}; resuming "kv_cache" also resumes "cuda_graph", as SGLang expects
  (sglang-api.md §7.6).
- `weight_version`: the version every engine reports in /model_info (None when they disagree).

`RemoteEngines.from_args(args)` is the one place that reads `lichen train` flags: it launches
`--rollout-num-engines` servers (stopped by `close()`) or connects to `--rollout-external-engine-addrs`, waits
for them, and checks that each routes the endpoints the configured features need (`required_endpoints`).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
import uuid
import weakref
from typing import Any, Awaitable, Sequence

from lichen.engines.client import (EngineClient, EngineError, EngineRequestError, EngineUnavailable,
                                   generate_payload, normalize_url, result_from_output)
from lichen.engines.engine import GenRequest, GenResult
from lichen.engines.router import Router
from lichen.errors import ConfigError
from lichen.observe.metrics import get_logger

log = get_logger(__name__)

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def required_endpoints(args: Any) -> dict[str, str]:
    """path -> the feature (flag) that needs it, for the configured run."""
    need = {"/generate": "rollout", "/model_info": "weight-version checks", "/health": "health checks"}
    if getattr(args, "update_weight_transport", None) == "disk" and not getattr(args, "debug_rollout_only", False):
        for path in ("/pause_generation", "/flush_cache", "/update_weights_from_disk", "/continue_generation"):
            need[path] = "--update-weight-transport disk"
    if getattr(args, "offload_rollout", False):
        for path in ("/flush_cache", "/release_memory_occupation", "/resume_memory_occupation"):
            need.setdefault(path, "--offload-rollout")
    return need


def launch_server_args(args: Any) -> list[str]:
    """`lichen serve` flags for launched engines: the trainer's device and dtype (float32, as the in-process
    engine), --rollout-max-batch-size, and the CPU threads split between the engines."""
    out = ["--device", str(getattr(args, "device", "auto") or "auto"), "--dtype", "float32"]
    if getattr(args, "rollout_max_batch_size", None):
        out += ["--max-batch-size", str(args.rollout_max_batch_size)]
    threads = getattr(args, "num_threads", None) or max(1, (os.cpu_count() or 1) // args.rollout_num_engines)
    out += ["--num-threads", str(threads)]
    return out


def _close_if_alive(ref: "weakref.ref[RemoteEngines]") -> None:
    engines = ref()
    if engines is not None:
        engines.close()


class RemoteEngines:
    """N engine servers as one engine. `launcher` (an EngineLauncher), when given, is stopped by `close()`."""

    is_remote = True

    def __init__(self, urls: Sequence[str], *, api_key: str | None = None, concurrency: int = 512,
                 max_retries: int = 3, retry_delay: float = 0.5, failover: bool = False, launcher: Any = None,
                 request_timeout: float | None = None):
        if not urls:
            raise ValueError("RemoteEngines needs at least one engine URL")
        self.launcher = launcher
        self.clients = [EngineClient(u, api_key=api_key, concurrency=concurrency, max_retries=max_retries,
                                     retry_delay=retry_delay, request_timeout=request_timeout) for u in urls]
        self.router = Router(self.clients, failover=failover)
        self.released: set[str] = set()
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="lichen-remote-engines", daemon=True)
        self._thread.start()
        # Closed at exit even if the owner never calls close(): connections closed, launched servers stopped.
        atexit.register(_close_if_alive, weakref.ref(self))

    def __repr__(self) -> str:
        return f"RemoteEngines({self.urls})"

    @property
    def urls(self) -> list[str]:
        return [c.url for c in self.clients]

    def _active(self) -> list[EngineClient]:
        return [self.clients[i] for i in self.router.in_rotation()]

    # ---- running coroutines -------------------------------------------------------------------------------
    def run(self, coro: Awaitable, timeout: float | None = None) -> Any:
        """Run `coro` on the engines' event loop and wait for it (an interrupt cancels it there too)."""
        if self._closed or threading.current_thread() is self._thread:
            if asyncio.iscoroutine(coro):
                coro.close()  # never scheduled: close it so Python does not warn that it was never awaited
            if self._closed:
                raise EngineError("these engines are closed")
            raise RuntimeError("RemoteEngines.run/generate called on the engines' own event loop (it would wait "
                               "for itself); await agenerate(...) there instead")
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except BaseException:
            fut.cancel()
            raise

    async def _each(self, fn, clients: list[EngineClient] | None = None) -> list:
        """fn(client) on every engine in rotation at once; if any fails, raise naming every failure."""
        clients = self._active() if clients is None else clients
        results = await asyncio.gather(*[fn(c) for c in clients], return_exceptions=True)
        errors = [(c, r) for c, r in zip(clients, results) if isinstance(r, BaseException)]
        if errors:
            if len(errors) == 1:
                raise errors[0][1]
            raise EngineError("; ".join(str(r) if str(r).startswith(c.url) else f"{c.url}: {r}" for c, r in errors))
        return results

    # ---- generation ---------------------------------------------------------------------------------------
    def generate(self, requests: list[GenRequest], session_ids: Sequence[str | None] | None = None, *,
                 allow_abort: bool = False) -> list[GenResult]:
        """Results in request order. An aborted request raises EngineError unless `allow_abort`."""
        if not requests:
            return []
        if session_ids is not None and len(session_ids) != len(requests):
            raise ValueError(f"{len(session_ids)} session ids for {len(requests)} requests")
        return self.run(self._generate_all(requests, session_ids, allow_abort))

    async def _generate_all(self, requests, session_ids, allow_abort) -> list[GenResult]:
        sids = session_ids if session_ids is not None else [None] * len(requests)
        tasks = [asyncio.ensure_future(self.agenerate(r, s, allow_abort=allow_abort)) for r, s in zip(requests, sids)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def agenerate(self, request: GenRequest, session_id: str | None = None, *, rid: str | None = None,
                        allow_abort: bool = False) -> GenResult:
        """One request, on the engines' loop (see `run`)."""
        index, out = await self.router.generate(generate_payload(request, rid=rid or uuid.uuid4().hex), session_id)
        url = self.clients[index].url
        result = result_from_output(out, url)
        if result.finish_reason == "abort" and not allow_abort:
            reason = out["meta_info"].get("finish_reason") or {}
            raise EngineError(f"{url} aborted a rollout request: {reason.get('message', reason)}")
        return result

    # ---- state and control --------------------------------------------------------------------------------
    def weight_versions(self) -> list[str | None]:
        return self.run(self._each(lambda c: c.weight_version()))

    @property
    def weight_version(self) -> str | None:
        """The version all engines in rotation report, or None when they disagree."""
        versions = set(self.weight_versions())
        return versions.pop() if len(versions) == 1 else None

    def update_weights_from_disk(self, path: str, version: str) -> None:
        """Every engine loads the HF checkpoint at `path` (readable by the servers) as weight version `version`."""
        self.run(self._each(lambda c: self._update_one(c, path, str(version))))

    async def _update_one(self, c: EngineClient, path: str, version: str) -> None:
        await c.call_json("POST", "/pause_generation", {})
        failure: BaseException | None = None
        try:
            await c.flush_cache()
            status, body = await c.request("POST", "/update_weights_from_disk",
                                            {"model_path": path, "weight_version": version,
                                             "abort_all_requests": False})
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

    def abort_all(self) -> None:
        self.run(self._each(lambda c: c.call_json("POST", "/abort_request", {"abort_all": True})))

    def offload(self) -> None:
        """Release weights and KV cache on every engine (a no-op on CPU servers, but the call sequence is real)."""
        if self.released:
            return

        async def release(c: EngineClient) -> None:
            await c.flush_cache()
            await c.call_json("POST", "/release_memory_occupation", {})

        self.run(self._each(release))
        self.released = set(MEMORY_TAGS)

    def onload(self, tags: list[str] | None = None) -> None:
        want = set(MEMORY_TAGS) if tags is None else set(tags)
        if "kv_cache" in want:
            want.add("cuda_graph")
        todo = [t for t in MEMORY_TAGS if t in want and t in self.released]
        if not todo:
            return
        self.run(self._each(lambda c: c.call_json("POST", "/resume_memory_occupation", {"tags": todo})))
        self.released.difference_update(todo)

    # ---- start-up checks ----------------------------------------------------------------------------------
    def wait_healthy(self, timeout: float = 120.0, *, reachable: bool = False) -> None:
        """Every engine answers /health with 200 (see EngineClient.wait_healthy for `reachable`)."""
        self.run(self._each(lambda c: c.wait_healthy(timeout, reachable=reachable)))

    def missing_endpoints(self, paths: Sequence[str]) -> dict[str, list[str]]:
        """url -> the paths of `paths` that engine does not route."""
        async def probe(c: EngineClient) -> list[str]:
            found = await asyncio.gather(*[c.has_endpoint(p) for p in paths])
            return [p for p, ok in zip(paths, found) if not ok]

        missing = self.run(self._each(probe))
        return {c.url: m for c, m in zip(self._active(), missing) if m}

    def require_endpoints(self, needed: dict[str, str]) -> None:
        """Raise ConfigError naming every engine that lacks an endpoint of `needed` (path -> what needs it)."""
        missing = self.missing_endpoints(list(needed))
        if missing:
            parts = [f"{url} lacks " + ", ".join(f"{p} (needed by {needed[p]})" for p in paths)
                     for url, paths in missing.items()]
            raise ConfigError("engine server endpoints missing: " + "; ".join(parts) + ". Use lichen serve or an "
                              "SGLang release that has them")

    # ---- construction from `lichen train` flags -------------------------------------------------------------
    @classmethod
    def from_args(cls, args: Any) -> "RemoteEngines":
        from lichen.engines.launcher import EngineLauncher

        launcher = None
        if args.rollout_num_engines:
            launcher = EngineLauncher(args.hf_checkpoint, args.rollout_num_engines,
                                      server_args=launch_server_args(args),
                                      log_dir=os.path.join(args.output_dir, "engines"))
            urls, api_key, flag = launcher.start(), None, "--rollout-num-engines"
        else:
            urls = [normalize_url(a) for a in args.rollout_external_engine_addrs]
            api_key, flag = getattr(args, "rollout_external_engine_api_key", None), "--rollout-external-engine-addrs"
        engines = None
        try:
            engines = cls(urls, api_key=api_key, concurrency=args.sglang_server_concurrency, launcher=launcher,
                          failover=bool(getattr(args, "use_fault_tolerance", False)))
            try:
                engines.wait_healthy(timeout=120.0, reachable=True)
                infos = engines.run(engines._each(lambda c: c.model_info()))
            except EngineRequestError as e:
                if e.status in (401, 403):
                    raise ConfigError(f"{flag}: {e.url} refused the key ({e.status}); give the server's key with "
                                      "--rollout-external-engine-api-key") from None
                raise
            except EngineUnavailable as e:
                raise ConfigError(f"{flag}: cannot reach an engine server: {e}") from None
            engines.require_endpoints(required_endpoints(args))
        except BaseException:
            if engines is not None:
                engines.close()
            elif launcher is not None:
                launcher.stop()
            raise
        for url, info in zip(urls, infos):
            log.info("engine %s: model %s, weight version %s", url, info.get("model_path"), info.get("weight_version"))
        return engines

    # ---- shutdown -----------------------------------------------------------------------------------------
    async def _aclose(self) -> None:
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
