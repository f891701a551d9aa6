"""Fault tolerance for engine servers (`--use-fault-tolerance`): a health monitor per engine, restarts, re-joins.

Every engine is watched by its own task on the engines' event loop. After `first_wait` seconds (large models
compile on their first requests) it calls `GET /health_generate` every `interval` seconds; an answer other than
200 within `timeout` seconds, or no connection, means the engine is dead or hung. Probes are suspended while the
engines are paused, syncing weights or offloaded (`suspend()` / `resume()`, and `RemoteEngines.released`): a
paused engine does not answer `/health_generate` (docs/architecture.md#pause-semantics), and must not be restarted
for it. A probe
that overlapped a suspension is discarded (`epoch` counts suspensions).

An engine found dead — by a probe, or by the router when its requests cannot connect — goes through

    active --(probe fails / unreachable)--> down --(restart, when lichen launched it)--> restarting --> pending
    pending --(next weight sync: loads the current version)--> active

- leaving rotation: `Router.fail` cancels every request the engine holds and sends each again, unchanged (same
  rid, same `sampling_seed`, so the same tokens), to healthy engines. Each request yields exactly one result,
  so no sample is lost or duplicated and every group keeps its n samples;
- restart (launched engines only): the process is killed (a hung one too) and started again on a new port;
  external engines are probed until they answer again;
- re-joining: a pending engine stays out of rotation until the next weight sync, which waits for restarts in
  progress and brings every engine to the current version (docs/architecture.md#engine-rejoin). Two exceptions keep a
  run from stalling:
  before any sync (the engines serve the launch checkpoint, which is current) an engine re-joins at once, and
  when no engine at all is in rotation a pending one loads the last synced version and re-joins.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from lichen.engines.clients.client import EngineUnavailable
from lichen.observe.metrics import get_logger

log = get_logger(__name__)

ACTIVE, DOWN, RESTARTING, PENDING, RETIRED = "active", "down", "restarting", "pending", "retired"

# slime's defaults: first probe after 300 s, then every 10 s, 5 s to answer.
DEFAULT_INTERVAL, DEFAULT_TIMEOUT, DEFAULT_FIRST_WAIT = 10.0, 5.0, 300.0


class HealthMonitor:
    """Watches the engines of `engines` (a RemoteEngines) and restarts those `launcher` started.

    Runs on the engines' event loop: `start()` from any thread; the other methods on that loop.
    `restarts[i]` counts restarts of engine i; `states[i]` is one of active / down / restarting / pending.
    """

    def __init__(
        self,
        engines: Any,
        *,
        interval: float = DEFAULT_INTERVAL,
        timeout: float = DEFAULT_TIMEOUT,
        first_wait: float = DEFAULT_FIRST_WAIT,
        launcher: Any = None,
        restart_timeout: float = 600.0,
    ):
        if interval <= 0 or timeout <= 0 or first_wait < 0:
            raise ValueError(
                f"health check interval {interval} and timeout {timeout} must be > 0, first wait {first_wait} >= 0"
            )
        self.engines = engines
        self.launcher = launcher
        self.interval, self.timeout, self.first_wait = interval, timeout, first_wait
        self.restart_timeout = restart_timeout
        n = len(engines.clients)
        self.states = [ACTIVE] * n
        self.restarts = [0] * n
        self.probes = [0] * n
        self.epoch = 0  # incremented by every suspend(): a probe that saw a suspension begin is discarded
        self._suspends = 0
        self._tasks: list[asyncio.Task] = []
        self._restarting: dict[int, asyncio.Task] = {}
        self._stop_lock = threading.Lock()
        self.stopping = False
        self.pool: Any = None  # an EnginePool (lichen.engines.clients.pool): retires engines, adds new ones

    def _watchers(self) -> list:
        return [self._watch_pool()] if self.pool is not None else []

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start watching (callable from any thread; the watchers run on the engines' loop)."""

        async def begin() -> None:
            watchers = [self._watch(i) for i in range(len(self.states))] + self._watchers()
            self._tasks = [asyncio.ensure_future(w) for w in watchers]

        self.engines.run(begin())

    async def stop(self) -> None:
        """Stop watching and restarting (on the loop); a restart still running kills what it started."""
        with self._stop_lock:
            self.stopping = True
        tasks = self._tasks + list(self._restarting.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- suspension ---------------------------------------------------------------------------------------
    def suspend(self) -> None:
        """No probe counts until the matching `resume()` (pause, weight sync)."""
        self._suspends += 1
        self.epoch += 1

    def resume(self) -> None:
        self._suspends = max(0, self._suspends - 1)
        if not self._suspends and not self.engines.router.active:
            for index in self.pending():  # re-joins put off while suspended, now that nothing else can serve
                asyncio.ensure_future(self.rejoin_if_needed(index))

    @property
    def suspended(self) -> bool:
        return self._suspends > 0 or bool(getattr(self.engines, "released", ()))

    # ---- probing ------------------------------------------------------------------------------------------
    async def probe(self, index: int) -> tuple[bool, str]:
        """One `/health_generate` call: (healthy, why not)."""
        client = self.engines.clients[index]
        self.probes[index] += 1
        try:
            status, _ = await asyncio.wait_for(
                client.request("GET", "/health_generate", timeout=self.timeout, retry=False), self.timeout + 1.0
            )
        except (EngineUnavailable, asyncio.TimeoutError) as e:
            what = "no answer" if isinstance(e, asyncio.TimeoutError) else "unreachable"
            return False, f"/health_generate: {what} within {self.timeout:g} s"
        if status != 200:
            return False, f"/health_generate answered HTTP {status}"
        return True, ""

    async def _watch(self, index: int) -> None:
        await asyncio.sleep(self.first_wait)
        while not self.stopping:
            try:
                await self._check(index)
            except Exception as e:  # noqa: BLE001 - the watcher must outlive any one failed check
                log.error("health check of engine %d failed unexpectedly: %s", index, e)
            await asyncio.sleep(self.interval)

    async def _watch_pool(self) -> None:
        """Read the pool's control file every interval (engines added while the run goes on)."""
        while not self.stopping:
            try:
                await self.pool.poll()
            except Exception as e:  # noqa: BLE001 - the watcher must outlive any one failed poll
                log.error("reading the engine control file failed unexpectedly: %s", e)
            await asyncio.sleep(self.interval)

    def watch_new(self, index: int) -> None:
        """Engine `index` was just added (alive, not yet at the current weights): pending, and watched."""
        self.states.append(PENDING)
        self.restarts.append(0)
        self.probes.append(0)
        assert len(self.states) == index + 1, "engines are added one at a time, at the end"
        self._tasks.append(asyncio.ensure_future(self._watch(index)))

    async def _check(self, index: int) -> None:
        """One round of watching engine `index`: probe it, or restart / wait for it when it is down."""
        state = self.states[index]
        if state == ACTIVE and not self.suspended:
            epoch = self.epoch
            ok, why = await self.probe(index)
            # a suspension that began meanwhile (pause, sync) explains a slow answer: not a failure
            if not ok and epoch == self.epoch and not self.suspended and self.states[index] == ACTIVE:
                self.engines.engine_failed(index, why)
        elif state == DOWN and self.launcher is not None and index not in self._restarting:
            self._begin_restart(index)  # an earlier restart failed: try again
        elif state == DOWN and self.launcher is None:
            ok, _ = await self.probe(index)  # an external engine: wait for it to answer again
            if ok and self.states[index] == DOWN:
                log.info("engine %s answers again", self.engines.clients[index].url)
                self.states[index] = PENDING
                await self.rejoin_if_needed(index)

    # ---- failures and restarts ----------------------------------------------------------------------------
    def on_down(self, index: int, reason: str) -> None:
        """An engine is out of rotation because it failed (the router's hook; also for pending engines)."""
        if self.states[index] in (DOWN, RESTARTING, RETIRED):
            return
        self.states[index] = DOWN
        if self.launcher is None:
            log.error(
                "engine %s is down (%s); lichen did not launch it, so it is probed until it answers again",
                self.engines.clients[index].url,
                reason,
            )
            return
        if not self.stopping:
            self._begin_restart(index)

    def _begin_restart(self, index: int) -> None:
        self.states[index] = RESTARTING
        self._restarting[index] = asyncio.ensure_future(self._restart(index))

    async def _restart(self, index: int) -> None:
        client = self.engines.clients[index]
        old = client.url
        loop = asyncio.get_running_loop()
        try:
            try:
                url = await loop.run_in_executor(None, restart_engine, self.launcher, index, self)
            except Exception as e:  # noqa: BLE001 - any failure to start leaves it down, retried next interval
                if self.pool is not None and self.pool.restart_failed(index, e):
                    self.states[index] = RETIRED  # never restarted or probed again
                    return
                log.error("restarting engine %d (%s) failed: %s", index, old, e)
                self.states[index] = DOWN
                return
            if url is None:  # stopping
                return
            await client.close()  # the old connections point at the dead process
            client.url = url
            self.restarts[index] += 1
            if self.pool is not None:
                self.pool.restart_succeeded(index)
            self.states[index] = PENDING
            log.warning("engine %d restarted: %s -> %s", index, old, url)
            await self.rejoin_if_needed(index)
        finally:
            self._restarting.pop(index, None)

    async def rejoin_if_needed(self, index: int) -> None:
        """Re-join now when waiting for the next sync would be wrong or would stall (see the module docstring)."""
        engines = self.engines
        if engines.router.fatal is not None:
            return
        # weights synced by broadcast leave no version to load: such an engine waits for the next sync
        stale = engines.synced and engines.last_weights is None
        if not self._suspends and (not engines.synced or (not stale and not engines.router.active)):
            try:
                await self.join(index, catch_up=engines.last_weights is not None)
            except Exception as e:  # noqa: BLE001
                log.error("engine %d could not re-join: %s", index, e)
                self.on_down(index, f"re-join failed: {e}")
        else:  # a sync or pause under way, or a sync to come, takes it in
            log.info(
                "engine %s stays out of rotation until the next weight sync brings it to the current version",
                engines.clients[index].url,
            )

    async def join(self, index: int, *, catch_up: bool) -> None:
        """Put engine `index` (out of rotation, alive) back into rotation, with `catch_up` first loading the last
        synced weights; it releases the memory the others have released, so all share one state."""
        engines = self.engines
        c = engines.clients[index]
        if catch_up and engines.last_weights is not None:
            await engines._update_one(c, *engines.last_weights)
        if engines.released:
            await c.flush_cache()
            await c.call_json("POST", "/release_memory_occupation", {"tags": sorted(engines.released)})
        self.states[index] = ACTIVE
        engines.router.restore(index)
        log.info(
            "engine %s is back in rotation (weight version %s)",
            c.url,
            engines.last_weights[1] if engines.last_weights else "as launched",
        )

    async def settle(self, timeout: float | None = None) -> None:
        """Wait for the restarts in progress (a weight sync then brings those engines up to date too)."""
        tasks = list(self._restarting.values())
        if tasks:
            log.info("waiting for %d engine restart(s) before the weight sync", len(tasks))
            await asyncio.wait(tasks, timeout=timeout if timeout is not None else self.restart_timeout)

    def pending(self) -> list[int]:
        return [i for i, s in enumerate(self.states) if s == PENDING]

    def stats(self) -> dict:
        return {"states": list(self.states), "restarts": list(self.restarts), "probes": list(self.probes)}


def restart_engine(launcher: Any, index: int, monitor: HealthMonitor | None = None) -> str | None:
    """Kill engine `index` of `launcher` (if still alive) and start it again; returns its new URL, or None when
    `monitor` began stopping meanwhile. Blocking (run it in a worker thread).

    The launcher's own `restart(index)` does the work (EngineLauncher, SGLangLauncher); once the launcher is
    stopped it refuses to start another server, so a restart racing with shutdown leaves nothing running."""
    stopping = (lambda: monitor.stopping) if monitor is not None else (lambda: False)
    if stopping():
        return None
    url = launcher.restart(index)
    return None if stopping() else url


def watch(
    engines: Any, *, interval: float, timeout: float, first_wait: float, pool: dict | None = None
) -> HealthMonitor:
    """Start a HealthMonitor on RemoteEngines `engines` (which must re-send a failed engine's requests: failover)
    with an EnginePool of keyword arguments `pool` (lichen.engines.clients.pool: retiring, the floor, engines added)."""
    from lichen.engines.clients.pool import EnginePool

    if not engines.router.failover:
        raise ValueError("a health monitor needs failover=True (requests of a failed engine are re-sent)")
    monitor = HealthMonitor(
        engines,
        interval=interval,
        timeout=timeout,
        first_wait=first_wait,
        launcher=engines.launcher,
        restart_timeout=float(getattr(engines.launcher, "ready_timeout", 600.0)),
    )
    monitor.pool = EnginePool(engines, **(pool or {}))
    engines.router.on_down = monitor.on_down
    # a request that finds every engine out waits for a restarted one rather than failing the step
    engines.router.no_engine_wait = monitor.restart_timeout
    monitor.start()
    return monitor
