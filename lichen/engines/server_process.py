"""Start and stop a `lichen serve` process, and a minimal blocking HTTP call (tests, tools, launchers).

The server is started with `--port 0` unless a port is given: it binds a free port itself and prints it in its
ready line, so there is no window in which another process can take a port picked in advance.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

_READY = re.compile(r"ready at http://(\S+):(\d+)")


class ServerProcess:
    """A `lichen serve` child process. `wait_ready()` blocks until it serves (and sets `port`); `stop()` sends
    SIGTERM and waits (SIGKILL after `grace` s)."""

    def __init__(self, proc: subprocess.Popen, host: str, cmd: list[str], log_path: str | None):
        self.proc, self.host, self.cmd, self.log_path = proc, host, cmd, log_path
        self.port: int | None = None
        self._found: list[int] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            m = _READY.search(line)
            if m and not self._found:
                self._found.append(int(m.group(2)))
        self.proc.stdout.close()

    def wait_ready(self, timeout: float = 120.0) -> "ServerProcess":
        """Wait for the ready line; raise RuntimeError with the log tail if the server exits or times out."""
        end = time.monotonic() + timeout
        while not self._found:
            if self.proc.poll() is not None or time.monotonic() > end:
                if self.proc.poll() is None:
                    self.proc.kill()
                    self.proc.wait()
                tail = ""
                if self.log_path and os.path.exists(self.log_path):
                    with open(self.log_path, errors="replace") as f:
                        tail = f.read()[-2000:]
                raise RuntimeError(f"lichen serve did not start (exit {self.proc.returncode}): "
                                   f"{' '.join(self.cmd)}\n{tail}")
            time.sleep(0.05)
        self.port = self._found[0]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, grace: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def launch(model: str, *args: str, host: str = "127.0.0.1", timeout: float = 120.0, wait: bool = True,
           log_path: str | None = None, env: dict | None = None) -> ServerProcess:
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
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                            env={**os.environ, **(env or {})})
    if log_path:
        err.close()
    server = ServerProcess(proc, host, cmd, log_path)
    return server.wait_ready(timeout) if wait else server


def call(url: str, body: Any = None, *, method: str | None = None, headers: dict | None = None,
         timeout: float = 60.0, raw: bytes | None = None) -> tuple[int, Any]:
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
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for line in resp:
            line = line.strip()
            if line.startswith(b"data:"):
                payload = line[5:].strip()
                yield "[DONE]" if payload == b"[DONE]" else json.loads(payload)


class ServerSet:
    """What both launchers (lichen serve, SGLang) share: `with launcher:` starts and stops the set, and the
    process facts. Subclasses hold `servers` (objects with `.proc`) and define `start()` and `stop()`."""

    servers: list

    def __enter__(self):
        if not self.servers:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def pids(self) -> list[int]:
        return [s.proc.pid for s in self.servers]

    def alive(self) -> list[bool]:
        return [s.proc.poll() is None for s in self.servers]
