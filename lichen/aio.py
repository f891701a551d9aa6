"""Small asyncio helpers shared by the engine client and the rollout code."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Iterable


async def gather_or_cancel(awaitables: Iterable[Awaitable[Any]]) -> list[Any]:
    """Run all `awaitables` concurrently; results in order.

    Unlike a bare `asyncio.gather`, the first failure (or a cancellation of the caller) cancels every sibling and
    waits for them to finish, so no request keeps running on an engine after its step has given up on it.
    """
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
