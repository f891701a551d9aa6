"""A stand-in for RemoteEngines whose requests answer from a script (the partial-rollout tests): tokens are a pure
function of the request's seed and length, chosen requests hang until abort_all."""

from __future__ import annotations

import asyncio
import threading
import time
import types

from lichen.engines.core.engine import GenRequest, GenResult


def scripted_tokens(req: GenRequest) -> list[int]:
    """What the stand-in generates for a request: a pure function of its seed and length, never EOS (1, 3)."""
    return [10 + (req.seed + len(req.input_ids) + i) % 50 for i in range(req.max_new_tokens)]


class ScriptedEngines:
    """Looks like RemoteEngines to the rollout (agenerate / submit / abort_all / clients). Requests are numbered in
    arrival order within a step; `hang[k] = t` makes request k produce t tokens and wait until abort_all, which
    answers it with finish "abort"; the others answer at once with all their tokens ("length"). One client with a
    concurrency cap of 2, so a request queued behind two hanging ones is never sent."""

    def __init__(self):
        self.clients = [types.SimpleNamespace(concurrency=2)]
        self.weight_version = "0"
        self.hang: dict[int, int] = {}
        self.received: list[GenRequest] = []
        self.sent = 0
        self.aborts = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._aborted = asyncio.run_coroutine_threadsafe(self._event(), self._loop).result()

    async def _event(self):
        return asyncio.Event()

    def new_step(self, hang: dict[int, int], sent: int = 0) -> None:
        """`hang`: see the class; `sent`: how many requests the step sends before its cut (the group filter waits
        for them, so the cut never depends on how fast the engine's thread runs)."""
        self.hang, self.received, self.sent = dict(hang), [], sent

    def wait_sent(self, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout  # a bound for a broken test only
        while len(self.received) < self.sent and time.monotonic() < end:
            time.sleep(0.005)

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def agenerate(self, req: GenRequest, session_id=None, *, allow_abort=False) -> GenResult:
        k = len(self.received)
        self.received.append(req)
        toks = scripted_tokens(req)
        lp = -0.5 if self.weight_version == "0" else -0.25
        if k not in self.hang:
            return GenResult(toks, [lp] * len(toks), "length", len(req.input_ids), self.weight_version)
        aborted = self._aborted
        await aborted.wait()
        t = self.hang[k]
        return GenResult(toks[:t], [lp] * t, "abort", len(req.input_ids), self.weight_version)

    def abort_all(self) -> None:
        def fire():
            self.aborts += 1
            self._aborted.set()
            self._aborted = asyncio.Event()

        self._loop.call_soon_threadsafe(fire)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
