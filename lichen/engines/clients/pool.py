"""Who is in the run's engine pool (--use-fault-tolerance): engines retired after failing their restarts, a floor
below which the run stops, and engines added while the run goes on (docs/fault-tolerance.md#engines-come-and-go).

- Retiring: a launched engine whose restart fails `max_failed_restarts` times in a row is retired: never
  restarted again, never probed, out of rotation for good. One warning says so and how many engines are left.
  If fewer than `min_healthy` engines are left that are not retired, the run stops with one line
  (EnginesBelowFloor, a RunError): every request, and every one waiting for an engine, fails with it.
- Adding: the control file (`<output dir>/engines.add`) is read every health-check interval. Each new line
  (the file is append-only: lines already read are not read again; a line counts once its newline is written) is
    - an engine server's address (`http://host:port` or `host:port`): lichen connects to it with the external
      engines' keys (--rollout-external-engine-api-key-file / $LICHEN_ENGINE_API_KEY), or
    - `launch`: lichen starts one more server as it started the others (its launcher's `add()`: lichen serve,
      SGLang or vLLM launched here, or a Ray engine actor; runs on external engines only refuse it);
  blank lines and `#` comments are skipped. The new engine must answer /health and /model_info and route every
  endpoint the run needs; then it waits out of rotation, like a restarted engine, until the next weight sync
  brings it to the current version (before the first sync: at once, it serves the launch checkpoint). A line
  that cannot be used gets one error naming the file, the line and what to do; the run goes on.
- Metrics: `engines/healthy` (in rotation), `engines/retired`, `engines/added`, `engines/restarts` (`pool_metrics`,
  each step).
"""

from __future__ import annotations

import asyncio
import os
import urllib.parse
from typing import Any, Mapping

from lichen.engines.clients.client import EngineError, normalize_url
from lichen.observe.metrics import get_logger
from lichen.safe_files import UnsafeFile, read_inside

log = get_logger(__name__)

RETIRED = "retired"
LAUNCH = "launch"
MAX_CONTROL_BYTES = 64 * 1024  # a control file larger than this is refused, not read
MAX_LINE_CHARS = 2048


class EnginePool:
    """The membership rules of `engines` (a RemoteEngines with a HealthMonitor); runs on the engines' loop."""

    def __init__(
        self,
        engines: Any,
        *,
        min_healthy: int = 1,
        max_failed_restarts: int = 3,
        control_file: str | None = None,
        add_keys: tuple[str | None, str | None] = (None, None),
        required: Mapping[str, str] | None = None,
    ):
        if min_healthy < 1 or max_failed_restarts < 1:
            raise ValueError(f"min_healthy {min_healthy} and max_failed_restarts {max_failed_restarts} must be >= 1")
        self.engines = engines
        self.min_healthy, self.max_failed_restarts = min_healthy, max_failed_restarts
        self.control_file = control_file
        self.add_keys = add_keys
        self.required = dict(required or {})
        self.failed_restarts: list[int] = [0] * len(engines.clients)  # in a row, per engine
        self.retired: list[int] = []
        self.added = 0
        self._lines_read = 0
        self._refused: str | None = None  # why the control file was last refused (each reason reported once)

    # ---- retiring -----------------------------------------------------------------------------------------
    def restart_succeeded(self, index: int) -> None:
        self.failed_restarts[index] = 0

    def restart_failed(self, index: int, error: BaseException) -> bool:
        """Count a failed restart of engine `index`; True when it is retired now (the caller stops trying)."""
        self.failed_restarts[index] += 1
        if self.failed_restarts[index] < self.max_failed_restarts:
            return False
        self.retired.append(index)
        url = self.engines.clients[index].url
        left = len(self.engines.clients) - len(self.retired)
        if left < self.min_healthy:
            reason = (
                f"engine {index} ({url}) failed {self.failed_restarts[index]} restarts in a row and was retired; "
                f"{left} engine(s) left, fewer than --min-healthy-engines {self.min_healthy}: the run stops "
                f"(last error: {_first_line(error)}; see the engine logs, add engines or lower the floor)"
            )
            self.engines.router.stop_all(reason)
            log.error("%s", reason)
        else:
            log.warning(
                "engine %d (%s) retired after %d failed restarts in a row (last: %s); the run continues on %d "
                "engine(s) (floor %d)",
                index,
                url,
                self.failed_restarts[index],
                _first_line(error),
                left,
                self.min_healthy,
            )
        return True

    # ---- adding -------------------------------------------------------------------------------------------
    def read_new_lines(self) -> list[tuple[int, str]]:
        """(line number, text) of the control file's lines not read before; a bad file gets one error."""
        path = self.control_file
        if not path or not os.path.lexists(path):
            return []
        try:  # a regular file inside the output directory: a FIFO or a link planted there cannot hang or leak
            raw = read_inside(os.path.dirname(path) or ".", os.path.basename(path), MAX_CONTROL_BYTES)
            text = raw.decode("utf-8")
            lines = text[: text.rfind("\n") + 1].splitlines()  # a last line still being written waits
        except (UnsafeFile, UnicodeDecodeError) as e:
            if self._refused != _first_line(e):  # once per reason, not every interval
                log.error("engine control file %s not read: %s; fix or remove it", path, _first_line(e))
            self._refused = _first_line(e)
            return []
        self._refused = None
        if len(lines) < self._lines_read:
            log.error(
                "engine control file %s has %d lines, %d were read before: lines are only appended, never removed; "
                "its old lines are not read again",
                path,
                len(lines),
                self._lines_read,
            )
            self._lines_read = len(lines)
            return []
        new = [(n + 1, lines[n].strip()) for n in range(self._lines_read, len(lines))]
        self._lines_read = len(lines)
        return [(n, t) for n, t in new if t and not t.startswith("#")]

    async def poll(self) -> None:
        """Add the engines the control file's new lines name (on the engines' loop)."""
        for number, text in self.read_new_lines():
            where = f"{self.control_file}:{number}"
            try:
                await self.add_line(text)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - one bad line must not end the run
                log.error("%s: engine not added: %s", where, _first_line(e))

    async def add_line(self, text: str) -> int:
        """Add the engine one control line names; returns its index."""
        if len(text) > MAX_LINE_CHARS:
            raise ValueError(f"a line of {len(text)} characters; give one address (http://host:port) or 'launch'")
        engines = self.engines
        if text == LAUNCH:
            launcher = engines.launcher
            if launcher is None or not hasattr(launcher, "add"):
                raise ValueError(
                    "'launch' starts one more engine as the run started its others; this run's engines are "
                    "external (--rollout-external-engine-addrs), started by no launcher of lichen's: give an "
                    "address instead"
                )
            url = await asyncio.get_running_loop().run_in_executor(None, launcher.add)
            keys: tuple[str | None, str | None] = (None, None)  # the run's own (the clients default to them)
        else:
            url = _address(text)
            if url in engines.urls:
                raise ValueError(f"{url} is already in the pool")
            keys = self.add_keys
        client = engines.make_client(url, *keys)
        try:
            await client.wait_healthy(60.0, reachable=True)
            await client.model_info()
            missing = [p for p in self.required if not await client.has_endpoint(p)]
        except BaseException:
            await client.close()  # a launched one is stopped with the others at the end of the run
            raise
        if missing:
            await client.close()
            raise EngineError(f"{url} lacks " + ", ".join(f"{p} (needed by {self.required[p]})" for p in missing))
        index = engines.router.add(client)
        self.failed_restarts.append(0)
        self.added += 1
        monitor = engines.monitor
        monitor.watch_new(index)  # out of rotation ("pending") until the next sync brings it up to date
        log.warning("engine %s added to the pool (engine %d); it gets work after its first weight sync", url, index)
        await monitor.rejoin_if_needed(index)
        return index

    def metrics(self) -> dict[str, float]:
        return {
            "engines/healthy": float(len(self.engines.router.in_rotation())),
            "engines/retired": float(len(self.retired)),
            "engines/added": float(self.added),
            "engines/restarts": float(sum(self.engines.monitor.restarts)),  # since the run (this attempt) began
        }


def _address(text: str) -> str:
    """The engine URL a control line gives, or ValueError saying what an address looks like."""
    bad = ValueError(f"{text[:100]!r} is not an engine address (http://host:port or host:port) nor 'launch'")
    if any(c.isspace() for c in text):
        raise bad
    try:
        url = normalize_url(text)
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # ValueError when not a number in range
    except ValueError:
        raise bad from None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None or parts.path.strip("/"):
        raise bad
    return url


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]


def pool_metrics(engine: Any) -> dict[str, float]:
    """The pool's metrics of a rollout's engine: {} for an engine without an EnginePool (in-process, no
    --use-fault-tolerance)."""
    pool = getattr(getattr(engine, "monitor", None), "pool", None)
    return pool.metrics() if pool is not None else {}
