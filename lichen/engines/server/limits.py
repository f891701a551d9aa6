"""Bounds on the work `lichen serve` accepts, so no client can make it queue without limit or hold its sockets.

- per request: at most `max_request_sequences` sequences (prompts x n); more is a 400 (the request can never
  fit; protocol.make_job refuses it at the first job past the cap, before the rest are built);
- queued: the sequences registered and not yet answered (waiting at the pause gate, queued, running) and their
  tokens (prompt + max_new_tokens each) stay under `max_queued_sequences` / `max_queued_tokens`; a request that
  would pass either is answered 503 with a JSON error and `Retry-After: 1` (lichen's client backs off and
  retries); one that could never fit, even into an empty queue, is a 400;
- sockets: a connection must deliver a request's complete headers within `header_timeout` seconds of its first
  byte (or of connecting), else it is closed (aiohttp itself has no such timeout: slow clients held sockets),
  and its body within `body_timeout` seconds once the headers are in (408, closed);
- bodies: at most `max_request_bytes`; a larger Content-Length is answered 413 before a byte of the body is
  read, a chunked body is cut off (413) when it grows past it. Then, before any tokenizing, counts (prompts x n)
  and lengths: a text longer than context_length x `longest_token_chars` characters cannot fit the context, so
  it is refused without being tokenized (protocol.check_text).

The defaults are `lichen serve`'s flags (lichen.engines.api.limit_defaults); `lichen train` sets the bounds of the
engines it launches from its own flags (lichen.engines.clients.launch_args.launch_server_args).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any

import torch
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from lichen.engines.api.limit_defaults import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_MAX_QUEUED_SEQUENCES,
    DEFAULT_MAX_QUEUED_TOKENS,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_REQUEST_SEQUENCES,
)
from lichen.engines.api.protocol import RequestError


class Overloaded(RequestError):
    """The queue is full: 503, `Retry-After: 1`; the request was not taken."""

    def __init__(self, message: str):
        super().__init__(message, status=503)


class BodyRefused(RequestError):
    """A body over --max-request-bytes (413) or not complete within --body-timeout (408); the connection is
    closed after the answer (the rest of the body was never read)."""


@dataclass(frozen=True)
class Limits:
    max_request_sequences: int = DEFAULT_MAX_REQUEST_SEQUENCES
    max_queued_sequences: int = DEFAULT_MAX_QUEUED_SEQUENCES
    max_queued_tokens: int = DEFAULT_MAX_QUEUED_TOKENS
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    body_timeout: float = DEFAULT_BODY_TIMEOUT

    def admit(self, seqs: int, tokens: int, queued_seqs: int, queued_tokens: int) -> None:
        """Raise unless `seqs` sequences of `tokens` tokens fit beside what is queued."""
        if seqs > self.max_queued_sequences or tokens > self.max_queued_tokens:
            raise RequestError(
                f"the request needs {seqs} sequences and {tokens} tokens (prompt + max_new_tokens), "
                f"more than this server ever queues ({self.max_queued_sequences} sequences, "
                f"{self.max_queued_tokens} tokens: --max-queued-sequences, --max-queued-tokens); "
                "split it or lower max_new_tokens"
            )
        if queued_seqs + seqs > self.max_queued_sequences or queued_tokens + tokens > self.max_queued_tokens:
            raise Overloaded(
                f"server busy: {queued_seqs} sequences ({queued_tokens} tokens) queued, the limit is "
                f"{self.max_queued_sequences} sequences and {self.max_queued_tokens} tokens; retry later"
            )


async def read_body(request: web.Request, limits: Limits) -> bytes:
    """The request's body within `limits` (aiohttp keeps it: later `request.read()` calls return it)."""
    cap = limits.max_request_bytes
    if request.content_length is not None and request.content_length > cap:
        raise BodyRefused(
            f"the request body has {request.content_length} bytes, more than this server takes ({cap}: "
            "lichen serve --max-request-bytes); send smaller requests (fewer prompts per request)",
            status=413,
            shape="object",
        )
    try:
        return await asyncio.wait_for(request.read(), limits.body_timeout)
    except asyncio.TimeoutError:
        raise BodyRefused(
            f"the request body was not complete within {limits.body_timeout:g} s (lichen serve --body-timeout)",
            status=408,
            shape="object",
        ) from None
    except web.HTTPRequestEntityTooLarge:  # a chunked body that grew past client_max_size
        raise BodyRefused(
            f"the request body is larger than this server takes ({cap} bytes: lichen serve --max-request-bytes)",
            status=413,
            shape="object",
        ) from None


def longest_token_chars(tokenizer: Any) -> int | None:
    """The most characters one token of `tokenizer`'s vocabulary spells (None when it cannot say).

    With byte-level BPE (llama 3, qwen) a vocabulary entry has one character per byte it covers, with SentencePiece
    one per character (byte-fallback entries such as <0xE4> count more than the byte they cover): either way no
    token covers more characters of the input than its entry has, so a text of more than
    context_length x this many characters has more tokens than the context holds, and can be refused before it
    is tokenized. (A normalizer that deletes input, as BERT's cleaning does, would break this; lichen serve's
    models use none.)
    """
    try:
        vocab = tokenizer.get_vocab()
        return max((len(k) for k in vocab), default=0) or None
    except Exception:  # a custom tokenizer without a vocabulary: only the body cap bounds its input
        return None


def job_tokens(job: Any) -> int:
    """What one job counts against the token bound: its prompt plus the most tokens it may generate."""
    return len(job.seq.input_ids) + int(job.seq.max_new_tokens or 0)


def torch_itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def free_memory_bytes(device: torch.device) -> int | None:
    """Memory still available for the KV cache on `device` (None when unknown)."""
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except Exception:  # a driver that cannot say: report the configured capacity
            return None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


# ---- header-read timeout ------------------------------------------------------------------------------------
class _TimedHandler(RequestHandler):
    """aiohttp's connection handler plus a deadline for each request's headers (see the module doc)."""

    __slots__ = ("_hdr_timeout", "_hdr_timer", "_hdr_seen")

    def __init__(self, *args: Any, header_timeout: float, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._hdr_timeout, self._hdr_timer, self._hdr_seen = header_timeout, None, 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._request_count != self._hdr_seen:  # a request's headers are complete
            self._hdr_seen = self._request_count
            self._disarm()
        elif self._hdr_timer is None and not self._request_in_progress:  # the first bytes of the next request
            self._arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._hdr_timer = self._loop.call_later(self._hdr_timeout, self._expire)

    def _disarm(self) -> None:
        if self._hdr_timer is not None:
            self._hdr_timer.cancel()
            self._hdr_timer = None

    def _expire(self) -> None:
        self._hdr_timer = None
        if self._request_count == self._hdr_seen and not self._request_in_progress:
            self.force_close()


class _TimedServer(web.Server):
    header_timeout: float = DEFAULT_HEADER_TIMEOUT

    def __call__(self) -> RequestHandler:
        return _TimedHandler(self, loop=self._loop, header_timeout=self.header_timeout, **self._kwargs)


class BoundedAppRunner(web.AppRunner):
    """An AppRunner whose connections get a header-read deadline (`header_timeout` s)."""

    def __init__(self, app: web.Application, *, header_timeout: float, **kwargs: Any):
        super().__init__(app, **kwargs)
        self._header_timeout = header_timeout

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _TimedServer  # same object, its connections made by _TimedHandler
        server.header_timeout = self._header_timeout
        return server
