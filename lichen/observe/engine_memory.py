"""The peak memory of engine servers per loop phase (`memory/engine{i}/<phase>_peak_rss_gb`, and
`_cuda_max_allocated_gb` on CUDA), for RunObserver: at a phase's start every engine in rotation gets
`POST /reset_peak_memory`, at its end `GET /server_info` reports its peaks in "memory" (lichen serve's own fields,
lichen/engines/server/info_endpoints.py). An engine that lacks them (SGLang) or does not answer adds nothing: the
metrics never cost the run.
"""

from __future__ import annotations

import asyncio
from typing import Any

TIMEOUT = 10.0


class EngineMemory:
    """memory_begin/memory_end (lichen.train.trainer_protocol's memory calls) over one RemoteEngines."""

    def __init__(self, engines: Any, first_index: int = 0) -> None:
        self.engines, self.first_index = engines, first_index

    def _ask(self, method: str, path: str) -> list[Any]:
        async def one(client: Any) -> Any:
            try:
                status, body = await client.request(method, path, timeout=TIMEOUT, retry=False)
            except Exception:
                return None
            return body if status == 200 and isinstance(body, dict) else None

        async def every() -> list[Any]:
            return list(await asyncio.gather(*[one(c) for c in self.engines.clients]))

        try:
            return self.engines.run(every(), timeout=TIMEOUT + 5)
        except Exception:
            return []

    def memory_begin(self) -> None:
        self._ask("POST", "/reset_peak_memory")

    def memory_end(self, phase: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for i, body in enumerate(self._ask("GET", "/server_info")):
            peaks = body.get("memory") if body else None
            if not isinstance(peaks, dict):
                continue
            for key, value in peaks.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    out[f"memory/engine{self.first_index + i}/{phase}_{key}"] = float(value)
        return out


def engine_memory_sources(engines: Any) -> list[EngineMemory]:
    """An EngineMemory for each RemoteEngines-like object of `engines` (with `clients` and `run`), numbered on."""
    out, n = [], 0
    for e in engines:
        if callable(getattr(e, "run", None)) and isinstance(getattr(e, "clients", None), list):
            out.append(EngineMemory(e, n))
            n += len(e.clients)
    return out
