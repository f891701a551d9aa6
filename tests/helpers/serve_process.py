"""Start `lichen serve` for a test, and blocking HTTP calls to it (one request, or an SSE stream)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from typing import Any

from lichen.engines.clients.server_process import ServerProcess


def launch(
    model: str,
    *args: str,
    host: str = "127.0.0.1",
    timeout: float = 120.0,
    wait: bool = True,
    log_path: str | None = None,
    env: dict | None = None,
) -> ServerProcess:
    """Start `python -m lichen.cli serve --model MODEL --host HOST --port 0 ARGS...`; with `wait`, wait until ready.

    `host` is where clients connect (127.0.0.1 also for a server bound to 0.0.0.0 via `--host` in ARGS).
    stderr goes to `log_path` (or is discarded). Without `wait`, call `wait_ready()` before using `url`.
    """
    cmd = [sys.executable, "-m", "lichen.cli", "serve", "--model", model]
    if "--host" not in args:
        cmd += ["--host", host]
    if "--port" not in args:
        cmd += ["--port", "0"]
    cmd += list(args)
    err = open(log_path, "ab") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env={**os.environ, **(env or {})})
    if log_path:
        err.close()
    server = ServerProcess(proc, host, cmd, log_path)
    return server.wait_ready(timeout) if wait else server


def call(
    url: str,
    body: Any = None,
    *,
    method: str | None = None,
    headers: dict | None = None,
    timeout: float = 60.0,
    raw: bytes | None = None,
) -> tuple[int, Any]:
    """One blocking HTTP request; returns (status, parsed JSON body, or text when not JSON, or None when empty)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    hdrs = {"Content-Type": "application/json"} if data is not None else {}
    hdrs.update(headers or {})
    req = urllib.request.Request(url, data=data, headers=hdrs, method=method or ("POST" if data is not None else "GET"))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, payload = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, payload = e.code, e.read()
    if not payload:
        return status, None
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, payload.decode(errors="replace")


def stream(url: str, body: Any, *, headers: dict | None = None, timeout: float = 60.0):
    """POST and yield each SSE `data:` payload (parsed JSON, or the string "[DONE]")."""
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for line in resp:
            line = line.strip()
            if line.startswith(b"data:"):
                payload = line[5:].strip()
                yield "[DONE]" if payload == b"[DONE]" else json.loads(payload)
