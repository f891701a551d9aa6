"""A `lichen serve` child process and the process facts both launchers share (tests/helpers/serve_process.py
starts one for the tests).

The server is started with `--port 0` unless a port is given: it binds a free port itself and prints it in its
ready line, so there is no window in which another process can take a port picked in advance.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time

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
        assert self.proc.stdout is not None  # started with stdout=PIPE
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
                raise RuntimeError(
                    f"lichen serve did not start (exit {self.proc.returncode}): {' '.join(self.cmd)}\n{tail}"
                )
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
