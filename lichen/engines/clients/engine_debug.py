"""What the hang watchdog and `--trace` ask every engine server (`GET /debug/stacks`, `GET /debug/trace`): answers
gathered under a time limit that never raises, since a diagnostic must not cost the run."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lichen.engines.clients.client import EngineClient
    from lichen.engines.clients.remote_engines import RemoteEngines


def ask_each(engines: RemoteEngines, path: str, timeout: float, params: dict | None = None) -> list[Any]:
    """Each server's (status, body) for `GET path`, or the exception it gave; never raises and waits at most
    `timeout` seconds."""

    async def ask(c: EngineClient) -> Any:
        try:
            return await c.request("GET", path, params=params, timeout=timeout, retry=False)
        except Exception as e:
            return e

    async def ask_all() -> list[Any]:
        return list(await asyncio.gather(*[ask(c) for c in engines.clients]))

    try:
        return engines.run(ask_all(), timeout=timeout + 5)
    except Exception as e:
        return [e for _ in engines.urls]


def stacks(engines: RemoteEngines, timeout: float = 10.0) -> dict[str, str]:
    """{url: every thread's stack} of each server, or why it gave none."""

    def text(answer: Any) -> str:
        if isinstance(answer, BaseException):
            return f"no answer: {type(answer).__name__}: {answer}"
        status, body = answer
        return body if status == 200 and isinstance(body, str) else f"HTTP {status}: {body}"

    return {url: text(a) for url, a in zip(engines.urls, ask_each(engines, "/debug/stacks", timeout))}


def trace(engines: RemoteEngines, since: float, timeout: float = 10.0) -> dict[str, dict]:
    """{url: its `GET /debug/trace?since=` answer} of the servers that gave one (lichen serve)."""
    answers = ask_each(engines, "/debug/trace", timeout, {"since": repr(since)})
    return {
        url: a[1]
        for url, a in zip(engines.urls, answers)
        if not isinstance(a, BaseException) and a[0] == 200 and isinstance(a[1], dict)
    }
