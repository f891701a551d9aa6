"""An async HTTP client for one engine server that speaks SGLang's native protocol (lichen serve or SGLang).

One `EngineClient` per server. It caps the `/generate` requests it has in flight (`--sglang-server-concurrency`;
more wait for a slot), retries a request whose connection failed (refused, reset, dropped before an answer:
`max_retries` more attempts, `retry_delay` s apart) and sends `Authorization: Bearer KEY` when given a key: the
admin key on the control endpoints when it has one (lichen.engines.api.auth), else the API key.

A server whose queue is full answers 503 with `Retry-After` (lichen serve's --max-queued-sequences / -tokens):
that request was not taken, so it is sent again after a growing pause (0.25 s doubling to 5 s) for up to
`overload_timeout` s, without using up `max_retries`.

A retried `/generate` carries the same `sampling_seed`, so it draws the same tokens as the lost attempt would
have (docs/architecture.md#sampling-seeds; lichen serve always honours the seed, SGLang with deterministic inference).

`generate_payload` / `result_from_output` translate between lichen's `GenRequest` / `GenResult` and the
`/generate` JSON (docs/architecture.md#generate-requests): tokens and log-probs are read from
`meta_info.output_token_logprobs`
(`[logprob, token_id, text]` triples), the finish reason from `meta_info.finish_reason.type`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, AsyncGenerator, AsyncIterator

import aiohttp

from lichen.engines.api.auth import key_for_path
from lichen.engines.core.engine import GenRequest, GenResult

# Statuses a proxy or a starting / overloaded server answers with; the request never ran, so it is retried.
RETRY_STATUSES = frozenset({502, 503, 504})
# A connection that fails in one of these ways never produced an answer: safe to send again.
CONNECTION_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError)


class EngineError(RuntimeError):
    """An engine server answered with an error or could not be used."""


class EngineUnavailable(EngineError):
    """The server could not be reached (connection refused / dropped) even after the retries."""


class EngineRequestError(EngineError):
    """The server answered with an HTTP error status; `status` and `body` hold what it said."""

    def __init__(self, url: str, path: str, status: int, body: Any):
        self.url, self.path, self.status, self.body = url, path, status, body
        super().__init__(f"{url}{path} answered HTTP {status}: {_message_of(body)}")


def _message_of(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in body:
            return str(body["message"])
        if isinstance(err, str):
            return err
    return str(body)[:500]


def normalize_url(addr: str) -> str:
    """`HOST:PORT`, `[IPv6]:PORT` or `http(s)://HOST:PORT[/]` -> `http(s)://HOST:PORT` (no trailing slash)."""
    addr = addr.strip().rstrip("/")
    return addr if addr.startswith(("http://", "https://")) else f"http://{addr}"


def generate_payload(req: GenRequest, *, rid: str | None = None) -> dict:
    """The `/generate` body for one request: token ids in, per-token log-probs out, lichen's sampling rules.

    Temperature <= 0 is sent as 0 (greedy on both servers). EOS and stop tokens stay in the output
    (`no_stop_trim`), as the in-process engine keeps them; text fields are not used.
    """
    sp: dict[str, Any] = {
        "max_new_tokens": int(req.max_new_tokens),
        "temperature": max(0.0, float(req.temperature)),
        "top_p": float(req.top_p),
        "top_k": int(req.top_k),
        "sampling_seed": int(req.seed),
        "no_stop_trim": True,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
    }
    if req.stop_token_ids:
        sp["stop_token_ids"] = [int(t) for t in req.stop_token_ids]
    if req.ignore_eos:
        sp["ignore_eos"] = True
    if req.return_sampling_mask:  # slime's request for the kept token sets (lichen serve; SGLang with slime's patch)
        sp["custom_params"] = {"return_top_p_token_ids": True}
    body: dict[str, Any] = {"input_ids": [int(t) for t in req.input_ids], "sampling_params": sp, "return_logprob": True}
    if rid is not None:
        body["rid"] = rid
    return body


def result_from_output(out: Any, url: str = "") -> GenResult:
    """A `/generate` response object -> GenResult. finish_reason is "stop", "length" or "abort"."""
    if not isinstance(out, dict) or not isinstance(out.get("meta_info"), dict):
        raise EngineError(f"{url}/generate: expected a JSON object with meta_info, got {str(out)[:200]}")
    meta = out["meta_info"]
    triples = meta.get("output_token_logprobs")
    if triples is None:
        raise EngineError(
            f"{url}/generate: the answer has no meta_info.output_token_logprobs although "
            "return_logprob was sent; this server does not follow SGLang's protocol"
        )
    tokens = [int(t[1]) for t in triples]
    logprobs = [float(t[0]) for t in triples]
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type", "length") if isinstance(finish, dict) else str(finish)
    prompt_tokens = int(meta.get("prompt_tokens", 0))
    version = str(meta.get("weight_version", ""))
    return GenResult(tokens, logprobs, kind, prompt_tokens, version, sampling_mask=kept_sets_of(meta, len(tokens), url))


def kept_sets_of(meta: dict, n: int, url: str = "") -> list[list[int]] | None:
    """The per-token kept ids of meta_info's `top_p_token_ids` / `top_p_token_offsets` (slime's ragged form), None
    when the server sent none (it does not implement the replay: the trainer then scores the full vocabulary)."""
    ids, offsets = meta.get("top_p_token_ids"), meta.get("top_p_token_offsets")
    if ids is None and offsets is None:
        return None
    ids, offsets = (ids, offsets) if isinstance(ids, list) and isinstance(offsets, list) else ([-1], [])
    ok = len(offsets) == n + 1 and all(isinstance(t, int) and t >= 0 for t in ids)
    ok = ok and all(isinstance(o, int) for o in offsets) and offsets[0] == 0 and offsets[-1] == len(ids)
    if not ok or any(a > b for a, b in zip(offsets, offsets[1:])):
        raise EngineError(
            f"{url}/generate: meta_info.top_p_token_ids / top_p_token_offsets must be token ids and n + 1 = {n + 1} "
            "non-decreasing offsets from 0 to len(ids) (the kept token sets of sampling-mask replay)"
        )
    return [ids[a:b] for a, b in zip(offsets, offsets[1:])]


class EngineClient:
    """Async client of one server at `url`. Use inside one event loop; `close()` when done.

    `outstanding` counts `/generate` calls accepted and not yet answered (waiting for a slot or in flight);
    the router balances on it. `attempts` counts HTTP attempts made (retries included).
    """

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        concurrency: int = 512,
        max_retries: int = 3,
        retry_delay: float = 0.5,
        connect_timeout: float = 10.0,
        request_timeout: float | None = None,
        overload_timeout: float = 600.0,
    ):
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.url = normalize_url(url)
        self.api_key, self.admin_api_key = api_key, admin_api_key
        self.overload_timeout = overload_timeout
        self.concurrency = concurrency
        self.max_retries = max_retries
        self.retry_delay = retry_delay
        self.timeout = aiohttp.ClientTimeout(total=request_timeout, sock_connect=connect_timeout)
        self.outstanding = 0
        self.in_flight = 0
        self.attempts = 0
        self._session: aiohttp.ClientSession | None = None
        self._slots: asyncio.Semaphore | None = None

    def __repr__(self) -> str:  # never the keys
        return f"EngineClient({self.url!r}, outstanding={self.outstanding})"

    def _ensure(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # Connections beyond the /generate cap are for control calls made while generation runs.
            connector = aiohttp.TCPConnector(limit=self.concurrency + 16, force_close=False)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self.timeout)
            self._slots = asyncio.Semaphore(self.concurrency)
        return self._session

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: dict | None = None,
        timeout: float | None = None,
        retry: bool = True,
    ) -> tuple[int, Any]:
        """One HTTP call with retries on connection errors and 502/503/504. Returns (status, JSON body, or text
        when the body is not JSON, or None when it is empty). Raises EngineUnavailable when every attempt
        failed to connect."""
        session = self._ensure()
        headers = self._headers(path, json_body=body is not None)
        kwargs: dict[str, Any] = {"params": params, "headers": headers}
        if body is not None:
            kwargs["data"] = json.dumps(body)
        if timeout is not None:
            kwargs["timeout"] = aiohttp.ClientTimeout(total=timeout, sock_connect=self.timeout.sock_connect)
        tries = 1 + (self.max_retries if retry else 0)
        last: BaseException | None = None
        attempt, pause, busy_until = 0, 0.25, None
        while attempt < tries:
            if attempt:
                await asyncio.sleep(self.retry_delay)
            self.attempts += 1
            try:
                async with session.request(method, self.url + path, **kwargs) as resp:
                    raw = await resp.read()
                    status, busy = resp.status, resp.headers.get("Retry-After") is not None
            except CONNECTION_ERRORS as e:
                last = e
                attempt += 1
                continue
            if status == 503 and busy and retry:  # queue full: the request was not taken; back off, send again
                loop = asyncio.get_running_loop()
                busy_until = busy_until or loop.time() + self.overload_timeout
                if loop.time() + pause <= busy_until:
                    await asyncio.sleep(pause)
                    pause = min(5.0, pause * 2)
                    continue
            attempt += 1
            if status in RETRY_STATUSES and attempt < tries:
                continue
            return status, _decode(raw)
        raise EngineUnavailable(
            f"{self.url}{path}: no answer after {tries} attempt(s) "
            f"({type(last).__name__}: {last}); is the server running?"
        )

    async def call_json(self, method: str, path: str, body: Any = None, **kwargs: Any) -> Any:
        """`request`, raising EngineRequestError unless the status is 2xx."""
        status, payload = await self.request(method, path, body, **kwargs)
        if not 200 <= status < 300:
            raise EngineRequestError(self.url, path, status, payload)
        return payload

    def _headers(self, path: str, json_body: bool) -> dict[str, str]:
        headers = {"Content-Type": "application/json"} if json_body else {}
        key = key_for_path(path, self.api_key, self.admin_api_key)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers

    @contextlib.asynccontextmanager
    async def _generate_slot(self) -> AsyncIterator[None]:
        """A /generate call under the concurrency cap, counted as outstanding while it waits and in flight while
        it runs (the router's load signals)."""
        self._ensure()
        assert self._slots is not None  # made with the session
        self.outstanding += 1
        try:
            async with self._slots:
                self.in_flight += 1
                try:
                    yield
                finally:
                    self.in_flight -= 1
        finally:
            self.outstanding -= 1

    async def generate(self, payload: dict) -> dict:
        """POST /generate with `payload` under the concurrency cap; returns the response object."""
        async with self._generate_slot():
            return await self.call_json("POST", "/generate", payload)

    async def generate_stream(self, payload: dict) -> AsyncGenerator[dict, None]:
        """POST /generate with `"stream": true` under the concurrency cap: each event's object (the output so far,
        as lichen serve and SGLang stream it) until [DONE]. Sent once, never retried (part of the output may have
        been used). Closing the iterator early closes the connection, which aborts the request on the server."""
        async with self._generate_slot():
            self.attempts += 1
            try:
                async with self._ensure().post(
                    self.url + "/generate",
                    data=json.dumps({**payload, "stream": True}),
                    headers=self._headers("/generate", json_body=True),
                ) as resp:
                    if resp.status != 200:
                        raise EngineRequestError(self.url, "/generate", resp.status, _decode(await resp.read()))
                    async for out in _sse_objects(resp):
                        if isinstance(out, dict) and "error" in out:
                            status = out["error"].get("code") if isinstance(out["error"], dict) else None
                            raise EngineRequestError(self.url, "/generate", int(status or 500), out)
                        yield out
            except CONNECTION_ERRORS as e:
                raise EngineUnavailable(f"{self.url}/generate: the stream broke ({type(e).__name__}: {e})") from None

    async def has_endpoint(self, path: str) -> bool:
        """Whether the server routes `path`, asked without side effects: an OPTIONS request answers 404 for an
        unknown path and 405 (or 200) for a known one, in aiohttp and in FastAPI (SGLang) alike. 401/403 mean
        the path exists but needs a key this client does not hold."""
        status, _ = await self.request("OPTIONS", path)
        return status != 404

    async def healthy(self, path: str = "/health", timeout: float = 5.0) -> bool:
        try:
            status, _ = await self.request("GET", path, timeout=timeout, retry=False)
        except (EngineUnavailable, asyncio.TimeoutError):
            return False
        return status == 200

    async def wait_healthy(
        self, timeout: float = 120.0, path: str = "/health", interval: float = 0.2, *, reachable: bool = False
    ) -> None:
        """Poll `path` until it answers 200; EngineUnavailable after `timeout` s. With `reachable`, a server
        that cannot be connected to at all (after the retries) fails at once: only a server that answers, but
        not yet 200 (SGLang answers 503 while it starts), is waited for."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            try:
                status, _ = await self.request(
                    "GET", path, timeout=max(1.0, min(10.0, end - loop.time())), retry=reachable
                )
            except EngineUnavailable:
                if reachable:
                    raise
                status = None
            except asyncio.TimeoutError:
                status = None
            if status == 200:
                return
            if loop.time() >= end:
                raise EngineUnavailable(
                    f"{self.url}{path} did not answer 200 within {timeout:g} s (last status: {status})"
                )
            await asyncio.sleep(interval)

    async def model_info(self) -> dict:
        info = await self.call_json("GET", "/model_info")
        if not isinstance(info, dict):
            raise EngineError(f"{self.url}/model_info: expected a JSON object, got {str(info)[:200]}")
        return info

    async def weight_version(self) -> str | None:
        """The version the server reports in /model_info (the portable place: docs/architecture.md#weight-versions)."""
        v = (await self.model_info()).get("weight_version")
        return None if v is None else str(v)

    async def flush_cache(self, *, attempts: int = 60, delay: float = 0.5) -> None:
        """GET /flush_cache until 200: it answers 400 while requests still run
        (docs/architecture.md#weight-update-sequence)."""
        for i in range(attempts):
            status, body = await self.request("GET", "/flush_cache")
            if status == 200:
                return
            if status != 400:
                raise EngineRequestError(self.url, "/flush_cache", status, body)
            if i + 1 < attempts:
                await asyncio.sleep(delay)
        raise EngineError(
            f"{self.url}/flush_cache kept answering 400 (requests still running) after {attempts} attempts"
        )


def _decode(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


async def _sse_objects(resp: aiohttp.ClientResponse) -> AsyncIterator[Any]:
    """The JSON object of each `data:` event of a server-sent-event response, until `data: [DONE]`. Read in
    pieces, not lines: one event (a long output with its log-probs) may pass aiohttp's line limit."""
    buf = b""
    async for data in resp.content.iter_any():
        *events, buf = (buf + data).split(b"\n\n")
        for event in events:
            if not event.startswith(b"data: "):
                continue
            if event[6:] == b"[DONE]":
                return
            yield json.loads(event[6:])
    raise EngineUnavailable(f"{resp.url}: the stream ended without [DONE]")
