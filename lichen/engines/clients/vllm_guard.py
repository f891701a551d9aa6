"""The key check lichen adds to the vLLM servers it launches (`--middleware lichen.engines.clients.vllm_guard.KeyGuard`).

vLLM's own `--api-key` guards only the paths under /v1, /v2, /inference and /cohere: with VLLM_SERVER_DEV_MODE=1
(which lichen needs for /pause, /resume, /abort_requests, /update_weight_version) the control plane — /pause,
/collective_rpc (runs a named method on every worker), /update_weights, /sleep, /reset_prefix_cache, ... — would
answer anyone who can reach the port. This middleware requires `Authorization: Bearer KEY` on every path except
/health and /metrics (open on lichen serve too: the readiness probe and the scrape, which change nothing) and OPTIONS
requests (answered by routing alone: lichen's endpoint probe). The key comes from the server's environment (VLLM_API_KEY, the variable vLLM itself
reads), never from its command line.

Runs inside vLLM's process: imports the standard library only (lichen is not installed in vLLM's environment; the
launcher puts this package on its PYTHONPATH).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any, Awaitable, Callable

KEY_ENV = "VLLM_API_KEY"
# as lichen serve's open paths (lichen.engines.api.auth.OPEN_PREFIXES): the readiness probe and the metrics scrape
OPEN_PATHS = frozenset({"/health", "/metrics"})

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class KeyGuard:
    """Pure ASGI middleware: 401 unless the request carries the key (see the module docstring)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], key: str | None = None) -> None:
        key = key if key is not None else os.environ.get(KEY_ENV, "")
        if not key:
            # a guard without a key would let everything through: refuse to start instead
            raise RuntimeError(f"lichen's KeyGuard needs the server's key in ${KEY_ENV}")
        self.app = app
        self._digest = hashlib.sha256(key.encode()).digest()

    def _allowed(self, scope: Scope) -> bool:
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if scope.get("method") == "OPTIONS" or path in OPEN_PATHS:
            return True
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                given = hashlib.sha256(token.encode()).digest()
                return scheme.lower() == "bearer" and hmac.compare_digest(given, self._digest)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": "Unauthorized: send Authorization: Bearer <the server's key>"}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})
