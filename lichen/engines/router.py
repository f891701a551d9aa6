"""Spreads `/generate` requests over N engine servers: least outstanding requests, sticky sessions.

Policy. A request goes to the engine in rotation with the fewest outstanding requests (accepted and not yet
answered, queued behind the engine's concurrency cap included); ties go round-robin, so equal engines take
turns. A request that names a `session_id` (a multi-turn conversation) goes to the engine that served the
session before, as long as that engine is in rotation, so its prefix cache is reused; a new session is placed
by the load rule and remembered (the most recent `max_sessions` sessions are kept).

Failover (`failover=True`, for fault tolerance): when an engine cannot be reached even after its client's
retries, it is taken out of rotation and the request is sent again, unchanged (same rid and sampling seed, so
the same tokens), to another engine; `reissued` counts such re-sends. Without failover the error propagates.
`restore(i)` puts an engine back (after it was restarted and brought to the current weights).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

from lichen.engines.client import EngineClient, EngineUnavailable
from lichen.observe.metrics import get_logger

log = get_logger(__name__)


class NoEngineAvailable(EngineUnavailable):
    """Every engine is out of rotation."""


class Router:
    def __init__(self, clients: Sequence[EngineClient], *, failover: bool = False, max_sessions: int = 100_000):
        if not clients:
            raise ValueError("a router needs at least one engine")
        self.clients = list(clients)
        self.failover = failover
        self.max_sessions = max_sessions
        self.active: set[int] = set(range(len(self.clients)))
        self.sessions: OrderedDict[str, int] = OrderedDict()
        self.reissued = 0
        self.routed = [0] * len(self.clients)  # requests sent to each engine (re-sends included)
        self._next = 0  # where the round-robin tie-break starts

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

    def pick(self, session_id: str | None = None) -> int:
        """The engine for the next request (see the module docstring)."""
        if not self.active:
            raise NoEngineAvailable(f"no engine in rotation (all of {self.urls} are out)")
        if session_id is not None:
            index = self.sessions.get(session_id)
            if index is not None and index in self.active:
                self.sessions.move_to_end(session_id)
                return index
        n = len(self.clients)
        order = [(self._next + k) % n for k in range(n)]
        index = min((i for i in order if i in self.active), key=lambda i: self.clients[i].outstanding)
        self._next = (index + 1) % n
        if session_id is not None:
            self.sessions[session_id] = index
            self.sessions.move_to_end(session_id)
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        return index

    def end_session(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    async def generate(self, payload: dict, session_id: str | None = None) -> tuple[int, dict]:
        """Send one `/generate` body; returns (engine index that answered, response object)."""
        while True:
            index = self.pick(session_id)
            client = self.clients[index]
            self.routed[index] += 1
            try:
                return index, await client.generate(payload)
            except EngineUnavailable as e:
                if not self.failover:
                    raise
                self.remove(index)
                self.reissued += 1
                log.warning("engine %s is unreachable (%s): out of rotation; re-sending the request to another "
                            "engine", client.url, e)

    async def close(self) -> None:
        for c in self.clients:
            await c.close()

    def stats(self) -> dict[str, Any]:
        return {"routed": list(self.routed), "reissued": self.reissued, "in_rotation": self.in_rotation()}
