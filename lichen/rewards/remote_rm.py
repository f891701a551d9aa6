"""The `remote_rm` reward: a reward model or verifier behind an HTTP endpoint (`--rm-url`).

Each sample is one `POST <url>` with the JSON body `{"prompt": ..., "response": ..., "label": ...}` (plus
`"metadata"` when the sample has any). The answer's JSON is the reward: a number, or an object (a dict reward,
read with `--reward-key`). Attempts: 1 + `max_retries`; a connection error, a timeout, HTTP 429 or any 5xx is
retried after `backoff_s * 2**attempt` seconds (times a jitter factor in [0.5, 1.0]); other 4xx answers and
bodies that are not JSON fail at once. At most `max_concurrency` requests are in flight per batch (the reward
runner's `--reward-concurrency` bounds them too). One HTTP session serves a whole batch: the runner enters
`batch_context()` around it; calls outside a batch open a session each.

With a key (`--rm-api-key-file PATH`, a file only its owner can read, or the environment variable
LICHEN_RM_API_KEY; never a flag, which every local user could read in `ps`) each request carries
`Authorization: Bearer KEY`. The key is registered with `lichen.observe.secrets`, so an error message or log line
that echoes it shows it redacted.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import random
from typing import Any, AsyncIterator

from lichen.errors import ConfigError
from lichen.observe.phases import phase
from lichen.observe.secrets import add_secrets
from lichen.observe.trace import REMOTE_ARG
from lichen.types import Sample

RM_KEY_ENV = "LICHEN_RM_API_KEY"

_session: contextvars.ContextVar = contextvars.ContextVar("lichen_remote_rm_session", default=None)


class RemoteRMError(RuntimeError):
    pass


def _aiohttp() -> Any:
    try:
        import aiohttp
    except ImportError as e:
        raise ConfigError("--rm-type remote_rm needs the aiohttp package: pip install 'aiohttp>=3.9'") from e
    return aiohttp


class RemoteRM:
    def __init__(
        self,
        url: str,
        *,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        request_timeout_s: float = 60.0,
        max_concurrency: int = 64,
        api_key: str | None = None,
    ) -> None:
        if not url or not url.startswith(("http://", "https://")):
            raise ConfigError(f"--rm-url {url!r}: give the reward endpoint as http(s)://host:port/path")
        _aiohttp()
        self.url = url
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.request_timeout_s = request_timeout_s
        self.max_concurrency = max_concurrency
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if api_key:
            add_secrets([api_key])

    @contextlib.asynccontextmanager
    async def batch_context(self) -> AsyncIterator[None]:
        aiohttp = _aiohttp()
        connector = aiohttp.TCPConnector(limit=self.max_concurrency)
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=self._headers) as session:
            token = _session.set((session, asyncio.Semaphore(self.max_concurrency)))
            try:
                yield
            finally:
                _session.reset(token)

    async def __call__(self, args: Any, sample: Sample) -> float | dict:
        body = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
        if sample.metadata:
            body["metadata"] = {k: v for k, v in sample.metadata.items() if k != "reward_error"}
        current = _session.get()
        if current is None:
            async with self.batch_context():
                return await self.post(body)
        return await self.post(body)

    async def post(self, body: dict) -> float | dict:
        aiohttp = _aiohttp()
        session, semaphore = _session.get()
        last_error = "no attempt"
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.0))
            try:  # each attempt a slice in the reward server's lane of the trace (--trace)
                async with semaphore, _timed(self.url, attempt), session.post(self.url, json=body) as resp:
                    if resp.status == 429 or resp.status >= 500:
                        last_error = f"HTTP {resp.status}"
                        continue
                    text = await resp.text()
                    if resp.status >= 400:
                        raise RemoteRMError(f"{self.url} answered HTTP {resp.status}: {text[:200]}")
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                last_error = f"{type(e).__name__}: {e}"
                continue
            return _parse_reward(text, self.url)
        raise RemoteRMError(f"{self.url}: no answer after {self.max_retries + 1} attempts (last: {last_error})")


@contextlib.asynccontextmanager
async def _timed(url: str, attempt: int) -> AsyncIterator[None]:
    """A request to the reward server as a phase of this process that the trace draws in the server's lane."""
    with phase("reward request", attempt=attempt, **{REMOTE_ARG: f"reward server {url}"}):
        yield


def rm_api_key(key_file: str | None) -> str | None:
    """The remote RM's key: from `--rm-api-key-file`, else LICHEN_RM_API_KEY, else None (no key sent)."""
    from lichen.key_files import resolve_key

    return resolve_key(
        flag_value=None, file_path=key_file, env=RM_KEY_ENV, flag=RM_KEY_ENV, file_flag="--rm-api-key-file"
    )


def _parse_reward(text: str, url: str) -> float | dict:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise RemoteRMError(f"{url} answered with a body that is not JSON: {text[:200]!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float, dict)):
        raise RemoteRMError(f"{url} answered {text[:200]!r}; expected a number or a JSON object")
    return float(value) if isinstance(value, (int, float)) else value
