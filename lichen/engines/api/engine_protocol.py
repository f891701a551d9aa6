"""What lichen's rollout needs of an engine, as typing protocols (structural: an engine implements them by having
the methods, nothing subclasses them).

- `BatchEngine`: `generate(requests)` returns one GenResult per request, in request order. The in-process
  `Engine` (lichen.engines.core.engine) and `RemoteEngines` (lichen.engines.clients.remote_engines) both are.
- `AsyncEngine`: `await agenerate(request, session_id)` one request at a time, and `agenerate_stream` the same
  as it grows; `session_id` keeps a conversation on one server. `RemoteEngines`, the in-process engine behind
  lichen.rollout.custom_generate.BatchingEngine, and the agent rollout's session engine are.
- `AbortableEngine`: an AsyncEngine whose calls a rollout thread starts on the engines' own event loop
  (`submit`, a concurrent Future) and whose servers stop what they run on `abort_all()`. Only `RemoteEngines`:
  dynamic sampling stops a round early over it (lichen.rollout.abort_surplus).
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, AsyncIterator, Coroutine, Protocol

from lichen.engines.core.engine import GenRequest, GenResult


class BatchEngine(Protocol):
    def generate(self, requests: list[GenRequest]) -> list[GenResult]: ...


class AsyncEngine(Protocol):
    async def agenerate(self, request: GenRequest, session_id: str | None = None) -> GenResult: ...

    def agenerate_stream(self, request: GenRequest, session_id: str | None = None) -> AsyncIterator[GenResult]: ...


class AbortableEngine(Protocol):
    async def agenerate(
        self, request: GenRequest, session_id: str | None = None, *, allow_abort: bool = False
    ) -> GenResult: ...

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]: ...

    def abort_all(self) -> None: ...
