"""Spreads `/generate` requests over N engine servers: least outstanding requests, sticky sessions.

Policy. A request goes to the engine in rotation with the fewest outstanding requests (routed to it and not yet
answered, queued behind the engine's concurrency cap included, counted from the pick itself); ties go round-robin, so equal engines take
turns. A request that names a `session_id` (a multi-turn conversation) goes to the engine that served the
session before, as long as that engine is in rotation, so its prefix cache is reused; a new session is placed
by the load rule and remembered (the most recent `max_sessions` sessions are kept).

Failover (`failover=True`, for fault tolerance): when an engine cannot be reached even after its client's
retries, it is taken out of rotation and the request is sent again, unchanged (same rid and sampling seed, so
the same tokens), to another engine; `reissued` counts such re-sends (`reissued_from[i]` those that left engine
i). Without failover the error propagates. `fail(i, reason)` does the same on the word of a health monitor: the
engine leaves rotation and every request it holds (in flight, or queued behind its client's concurrency cap) is
cancelled there and re-sent elsewhere, so a hung engine loses nothing. `on_down(i, reason)`, when set, is told
of every engine taken out this way (the health monitor restarts it). `restore(i)` puts an engine back (after it
was restarted and brought to the current weights). With `no_engine_wait` > 0 (failover only), a request that
finds no engine in rotation waits that many seconds for one to be restored before it fails.

Logging: an engine that leaves rotation gets ONE warning (`Failover`), printed once every request it held has been
answered elsewhere: what left, why, how many requests were re-sent, how long they took; each re-send is a debug
line. `add(client)` grows the pool (lichen.engines.clients.pool); `stop_all(reason)` ends it (below the engine floor).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from typing import Any, AsyncGenerator, Callable, Sequence

from lichen.engines.clients.client import EngineClient, EngineUnavailable
from lichen.errors import RunError
from lichen.observe.metrics import get_logger

log = get_logger(__name__)


class NoEngineAvailable(EngineUnavailable):
    """Every engine is out of rotation."""


class EnginesBelowFloor(NoEngineAvailable, RunError):
    """Fewer engines than --min-healthy-engines are left (the others retired): the run stops with one line."""


class Failover:
    """One engine leaving rotation, summed up in ONE warning once every request it held has been answered
    elsewhere (or has failed): what died, why, how many requests were re-sent, how long until the last answered.
    The per-request detail is at debug level (one engine with 153 requests in flight printed 153 lines)."""

    def __init__(self, url: str, reason: str, held: int):
        self.url, self.reason = url, reason
        self.started = time.monotonic()
        self.resent = self.open = held  # requests taken back from the engine / of those, not answered yet
        self.reported = False

    def add(self) -> None:
        """One more request re-sent for this failure (one that found the engine unreachable on its own)."""
        self.resent += 1
        self.open += 1

    def done_one(self) -> None:
        self.open -= 1
        self.report_if_done()

    def report_if_done(self, *, final: bool = False) -> None:
        if self.reported or (self.open > 0 and not final):
            return
        self.reported = True
        if not self.resent:
            log.warning("engine %s left rotation (%s); it held no request", self.url, self.reason)
            return
        left = f"; {self.open} still unanswered when the router closed" if self.open > 0 else ""
        log.warning(
            "engine %s left rotation (%s): %d request(s) it held re-sent to other engines, all answered %.1f s later%s",
            self.url,
            self.reason,
            self.resent,
            time.monotonic() - self.started,
            left,
        )


class Router:
    def __init__(
        self,
        clients: Sequence[EngineClient],
        *,
        failover: bool = False,
        max_sessions: int = 100_000,
        no_engine_wait: float = 0.0,
    ):
        if not clients:
            raise ValueError("a router needs at least one engine")
        self.clients = list(clients)
        self.failover = failover
        self.max_sessions = max_sessions
        self.no_engine_wait = no_engine_wait
        self.active: set[int] = set(range(len(self.clients)))
        self.sessions: OrderedDict[str, int] = OrderedDict()
        self.reissued = 0
        self.reissued_from = [0] * len(self.clients)  # re-sends of requests that engine i held
        self.routed = [0] * len(self.clients)  # requests sent to each engine (re-sends included)
        self.on_down: Callable[[int, str], None] | None = None
        self._next = 0  # where the round-robin tie-break starts
        self._attempts: list[set[asyncio.Future]] = [set() for _ in self.clients]  # per engine, not yet answered
        # Requests routed to each engine and not yet ended, counted at the pick itself: a client's own `outstanding`
        # counts only once its call has started running, so a burst of picks made before then all saw the same
        # stale counts and could pile onto one engine (16 requests at once split 2:14).
        self._load = [0] * len(self.clients)
        self._restored: asyncio.Event | None = None  # created on the event loop that first waits on it
        self.fatal: str | None = None  # set by stop_all(): the run cannot go on
        self._failovers: dict[int, Failover] = {}  # engine index -> its latest failure (summed up in one line)
        self._taken_by: dict[asyncio.Future, Failover] = {}  # a request fail() took back -> that failure

    @property
    def urls(self) -> list[str]:
        return [c.url for c in self.clients]

    def in_rotation(self) -> list[int]:
        return sorted(self.active)

    def remove(self, index: int) -> None:
        """Take engine `index` out of rotation; its sessions move to other engines on their next request."""
        self.active.discard(index)

    def restore(self, index: int) -> None:
        self.active.add(index)
        if self._restored is not None:
            self._restored.set()

    def add(self, client: EngineClient) -> int:
        """A new engine, out of rotation until `restore` (after it has the current weights); returns its index."""
        self.clients.append(client)
        self.reissued_from.append(0)
        self.routed.append(0)
        self._attempts.append(set())
        self._load.append(0)
        return len(self.clients) - 1

    def stop_all(self, reason: str) -> None:
        """Too few engines are left: every request now, and every one waiting for an engine, fails with `reason`."""
        self.fatal = reason
        self.active.clear()
        if self._restored is not None:
            self._restored.set()

    def fail(self, index: int, reason: str, *, own: bool = False) -> int:
        """Take engine `index` out of rotation and cancel the requests it holds; `generate` re-sends each to
        another engine. Tells `on_down` (once per removal). `own`: the caller's request (which found the engine
        unreachable) is re-sent too. Returns how many requests were taken back."""
        was_active = index in self.active
        self.remove(index)
        if was_active or index not in self._failovers:
            self._failovers[index] = Failover(self.clients[index].url, reason, 0)
        event = self._failovers[index]
        taken = 0
        for attempt in list(self._attempts[index]):
            if not attempt.done():
                attempt.cancel()
                self._taken_by[attempt] = event
                event.add()
                taken += 1
        if own:
            event.add()
        if was_active:
            log.debug("engine %s out of rotation (%s); took back %d request(s)", self.clients[index].url, reason, taken)
            event.report_if_done()  # nothing to re-send: the summary now
            if self.on_down is not None:
                self.on_down(index, reason)
        return taken

    def held(self, index: int) -> int:
        """Requests engine `index` holds right now (sent or queued for it, not yet answered)."""
        return sum(not a.done() for a in self._attempts[index])

    def pick(self, session_id: str | None = None) -> int:
        """The engine for the next request (see the module docstring)."""
        if self.fatal is not None:
            raise EnginesBelowFloor(self.fatal)
        if not self.active:
            raise NoEngineAvailable(f"no engine in rotation (all of {self.urls} are out)")
        if session_id is not None:
            index = self.sessions.get(session_id)
            if index is not None and index in self.active:
                self.sessions.move_to_end(session_id)
                return index
        n = len(self.clients)
        order = [(self._next + k) % n for k in range(n)]
        index = min((i for i in order if i in self.active), key=lambda i: self._load[i])
        self._next = (index + 1) % n
        if session_id is not None:
            self.sessions[session_id] = index
            self.sessions.move_to_end(session_id)
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        return index

    def end_session(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    async def _pick_or_wait(self, session_id: str | None) -> int:
        """`pick`, or with failover and `no_engine_wait`, wait up to that long for an engine to be restored."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.no_engine_wait
        while True:
            try:
                return self.pick(session_id)
            except NoEngineAvailable:
                left = end - loop.time()
                if not self.failover or left <= 0 or self.fatal is not None:
                    raise
            if self._restored is None:
                self._restored = asyncio.Event()
            self._restored.clear()
            try:
                await asyncio.wait_for(self._restored.wait(), left)
            except asyncio.TimeoutError:
                pass

    async def generate(self, payload: dict, session_id: str | None = None) -> tuple[int, dict]:
        """Send one `/generate` body; returns (engine index that answered, response object)."""
        failovers: list[Failover] = []  # the engine failures this request was re-sent for (told when it ends)
        try:
            while True:
                index = await self._pick_or_wait(session_id)
                client = self.clients[index]
                self.routed[index] += 1
                self._load[index] += 1
                attempt = asyncio.ensure_future(client.generate(payload))
                self._attempts[index].add(attempt)
                try:
                    # wait() rather than await: a cancel by fail() must not look like a cancel of this task
                    await asyncio.wait({attempt})
                except asyncio.CancelledError:
                    attempt.cancel()
                    taken_by = self._taken_by.pop(attempt, None)
                    if taken_by is not None:  # taken back, then its caller gave up: not re-sent after all
                        taken_by.done_one()
                    raise
                finally:
                    self._attempts[index].discard(attempt)
                    self._load[index] -= 1
                event = self._taken_by.pop(attempt, None)
                if attempt.cancelled():  # fail(index) took it back
                    why = "its engine was taken out of rotation"
                else:
                    try:
                        return index, attempt.result()
                    except EngineUnavailable as e:
                        if not self.failover:
                            raise
                        why = f"unreachable: {e}"
                        self.fail(index, why, own=True)
                        event = self._failovers[index]
                self.reissued += 1
                self.reissued_from[index] += 1
                if event is not None:
                    failovers.append(event)  # counted by fail(): told when this request ends
                log.debug("re-sending a request that %s held (%s)", client.url, why)
        finally:
            for event in failovers:
                event.done_one()

    async def generate_stream(
        self, payload: dict, session_id: str | None = None
    ) -> AsyncGenerator[tuple[int, dict], None]:
        """`generate` streamed: (engine index, output so far) per event. Picked as `generate` picks, but sent once:
        a stream that started is not re-sent on failover, nor taken back by `fail` (its connection ends with the
        engine)."""
        index = await self._pick_or_wait(session_id)
        self.routed[index] += 1
        self._load[index] += 1
        try:
            async with contextlib.aclosing(self.clients[index].generate_stream(payload)) as events:
                async for out in events:
                    yield index, out
        finally:
            self._load[index] -= 1

    async def close(self) -> None:
        for event in self._failovers.values():
            event.report_if_done(final=True)
        for c in self.clients:
            await c.close()

    def stats(self) -> dict[str, Any]:
        return {
            "routed": list(self.routed),
            "reissued": self.reissued,
            "reissued_from": list(self.reissued_from),
            "in_rotation": self.in_rotation(),
        }
