"""Launches K `lichen serve` processes on free loopback ports and makes sure they stop with their parent.

    with EngineLauncher(model_dir, 2, server_args=["--dtype", "float32"]) as launcher:
        urls = launcher.urls      # started, ready and answering /health
    # here every server has exited

Each server binds `--port 0` and reports the port it got (lichen.engines.clients.server_process), so no port is picked
in advance for another process to take. The servers stop when:
- `stop()` is called or the `with` block ends (also by an exception);
- the parent exits normally, by an uncaught exception or by Ctrl-C (SIGINT → KeyboardInterrupt → atexit);
- the parent gets SIGTERM (a handler turns it into SystemExit(143), so the same cleanup runs), when the
  handler could be installed (main thread, no handler of the caller's own);
- the parent dies without cleanup (SIGKILL): on Linux each server is started through a small wrapper that sets
  the parent-death signal (prctl PR_SET_PDEATHSIG = SIGTERM) before it execs, from the process' long-lived
  spawner thread (lichen.lifetime: the signal follows the thread that started the child, so restarts, which run
  in worker threads, are covered too).

The servers are keyed: the launcher makes a random API key and admin key (lichen.engines.api.auth) and hands them
over in the servers' environment (LICHEN_API_KEY, LICHEN_ADMIN_API_KEY), never on their command line, which every
local user can read; `api_key` / `admin_api_key` are what clients send (RemoteEngines takes them from the launcher).
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import Sequence

from lichen.engines.api.auth import SERVE_ADMIN_KEY_ENV, SERVE_KEY_ENV, new_key
from lichen.engines.clients.server_process import ServerProcess, ServerSet
from lichen.errors import UserError
from lichen.lifetime import die_with_parent, spawn
from lichen.observe.metrics import get_logger

log = get_logger(__name__)

_LIVE: "weakref.WeakSet[EngineLauncher]" = weakref.WeakSet()
_hooks_installed = False


class EngineLaunchError(UserError):
    """A server did not start (its log tail is in the message)."""


def _stop_all_live() -> None:
    for launcher in list(_LIVE):
        launcher.stop()


def _on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _install_exit_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(_stop_all_live)
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


class EngineLauncher(ServerSet):
    """K `lichen serve --model MODEL --host HOST --port 0 SERVER_ARGS...` processes.

    `log_dir`: each server's stderr goes to `log_dir/engine_{i}.log` (default: a temporary directory, removed by
    `stop()`; a failed start quotes the log's tail either way). `ready_timeout`: seconds for all servers to come
    up. `keyed`: give the servers fresh random keys (see the module doc).
    """

    def __init__(
        self,
        model: str,
        num_engines: int,
        *,
        host: str = "127.0.0.1",
        server_args: Sequence[str] = (),
        log_dir: str | None = None,
        ready_timeout: float = 300.0,
        env: dict | None = None,
        keyed: bool = True,
    ):
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        if any(a.startswith(("--api-key", "--admin-api-key")) for a in server_args):
            raise ValueError(
                "server_args must not carry keys (every local user can read a command line); "
                "the launcher keys the servers through their environment"
            )
        self.model, self.num_engines, self.host = model, num_engines, host
        self.server_args = list(server_args)
        self.log_dir = log_dir
        self._tmp_log_dir: str | None = None
        self.ready_timeout = ready_timeout
        self.api_key = self.admin_api_key = None
        if keyed:
            self.api_key, self.admin_api_key = new_key(), new_key()
        self.env = dict(env or {})
        self._key_env = {SERVE_KEY_ENV: self.api_key, SERVE_ADMIN_KEY_ENV: self.admin_api_key} if keyed else {}
        self.servers: list[ServerProcess] = []
        self._lock = threading.Lock()  # guards `servers` and `_stopped` (restart runs in a worker thread)
        self._stopped = False

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> list[str]:
        """Start every server, wait until all are ready; on any failure stop them all and raise
        EngineLaunchError. Returns the servers' URLs."""
        _install_exit_hooks()
        _LIVE.add(self)
        self._stopped = False
        try:
            for i in range(self.num_engines):
                self.servers.append(self._spawn(i))
            end = time.monotonic() + self.ready_timeout
            for s in self.servers:
                try:
                    s.wait_ready(max(1.0, end - time.monotonic()))
                except RuntimeError as e:
                    raise EngineLaunchError(f"--rollout-num-engines: an engine server failed to start: {e}") from None
        except BaseException:
            self.stop()
            raise
        log.info("started %d lichen serve engine(s): %s", len(self.servers), ", ".join(self.urls))
        return self.urls

    def _spawn(self, i: int) -> ServerProcess:
        serve = [
            "-m",
            "lichen.cli",
            "serve",
            "--model",
            self.model,
            "--host",
            self.host,
            "--port",
            "0",
            *self.server_args,
        ]
        cmd = die_with_parent([sys.executable, *serve])
        log_dir = self.log_dir
        if not log_dir:
            if self._tmp_log_dir is None:
                self._tmp_log_dir = tempfile.mkdtemp(prefix="lichen-engines-")
            log_dir = self._tmp_log_dir
        os.makedirs(log_dir, exist_ok=True)
        log_path = os.path.join(log_dir, f"engine_{i}.log")
        env = {**os.environ, **self.env, **self._key_env}
        with open(log_path, "ab") as err:
            proc = spawn(lambda: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env))
        return ServerProcess(proc, self.host, [sys.executable, *serve], log_path)

    def restart(self, index: int) -> str:
        """Kill server `index` (dead or hung: no graceful shutdown) and start it again with its launch command,
        on a new port (its log file is appended to); returns its new URL once it answers /health.

        Blocking: call it from a worker thread. Once `stop()` has begun, a restart raises EngineLaunchError
        instead of starting a server nobody would stop; a server started just before `stop()` is stopped by it.
        """
        with self._lock:
            if self._stopped:
                raise EngineLaunchError(f"cannot restart engine {index}: the engine launcher is stopped")
            old = self.servers[index]
            if old.proc.poll() is None:
                old.proc.kill()
            try:
                old.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
            self.servers[index] = new = self._spawn(index)
        try:
            new.wait_ready(self.ready_timeout)
        except RuntimeError as e:
            raise EngineLaunchError(f"engine {index} did not come back: {e}") from None
        return new.url

    def add(self) -> str:
        """Start one more server (engine index len(servers), e.g. from the run's engine control file); returns its
        URL once it answers. Blocking (call it from a worker thread)."""
        with self._lock:
            if self._stopped:
                raise EngineLaunchError("cannot add an engine: the engine launcher is stopped")
            index = len(self.servers)
            self.servers.append(self._spawn(index))
            new = self.servers[index]
        try:
            new.wait_ready(self.ready_timeout)
        except RuntimeError as e:
            raise EngineLaunchError(f"the added engine {index} did not start: {e}") from None
        self.num_engines = len(self.servers)
        return new.url

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM every server (they abort what runs and exit), wait up to `grace` s, then SIGKILL. Idempotent."""
        with self._lock:
            self._stopped = True
            live = [s for s in self.servers if s.proc.poll() is None]
            for s in live:
                try:
                    s.proc.terminate()
                except ProcessLookupError:
                    pass
            end = time.monotonic() + grace
            for s in live:
                try:
                    s.proc.wait(max(0.0, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    s.proc.kill()
                    s.proc.wait()
            _LIVE.discard(self)
            if self._tmp_log_dir is not None:
                shutil.rmtree(self._tmp_log_dir, ignore_errors=True)
                self._tmp_log_dir = None
        if live:
            log.info("stopped %d lichen serve engine(s)", len(live))

    # ---- information --------------------------------------------------------------------------------------
    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers if s.port is not None]
