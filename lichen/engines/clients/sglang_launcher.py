"""Launches SGLang servers for `--rollout-engine-backend sglang --rollout-num-engines K` (GPU machines).

Engine i runs

    python -m sglang.launch_server --model-path CKPT --host 127.0.0.1 --port P_i --tp-size N --base-gpu-id i*N
        --random-seed SEED --dtype DTYPE [--enable-memory-saver] [--max-running-requests M] PASS-THROUGH...

- what lichen sets (LICHEN_SETS) comes from lichen's own flags: the checkpoint (--hf-checkpoint), a free loopback
  port per engine, tensor parallelism (--rollout-num-gpus-per-engine; engine i takes GPUs i*N .. i*N+N-1), the
  seed (--seed), the dtype (--bf16: bfloat16, else float32, the trainer's dtype, so rollout and trainer log-probs
  agree), the memory saver that /release_memory_occupation needs (--offload-rollout) and the batch cap
  (--rollout-max-batch-size, when given). A `--sglang-<flag>` naming one of these is an error that says which
  lichen flag decides it;
- every other `--sglang-<flag> [VALUE...]` is passed through verbatim as `--<flag> [VALUE...]` (e.g.
  `--sglang-mem-fraction-static 0.7`, `--sglang-enable-deterministic-inference`, which makes SGLang honour the
  per-sample `sampling_seed`). lichen does not check them: SGLang does, and its error is in the engine's log.

A server is ready when `GET /health_generate` answers 200 (docs/architecture.md#engine-endpoints). Each server runs
in its own process
group, so stopping it also stops the scheduler and detokenizer processes SGLang forks; `stop()` (also at exit)
sends SIGTERM to the group and SIGKILL after a grace period. `restart(i)` kills engine i's group and starts it
again on a new port (the fault-tolerance monitor uses it); `add()` starts one more engine, index K, K+1, ... (a
`launch` line of the engine control file, docs/fault-tolerance.md#engines-come-and-go). An added engine takes the
next GPUs, as engine i takes GPUs i*N .. i*N+N-1 of those lichen was given (`gpus`, from CUDA_VISIBLE_DEVICES or
every GPU the machine has): one past them is refused, never started on GPUs another engine holds. Without CUDA there
is nothing to place.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from typing import TYPE_CHECKING, Any, Sequence

from lichen.engines.api.auth import SERVE_KEY_ENV, new_key
from lichen.engines.clients.server_process import ServerSet
from lichen.errors import ConfigError, UserError
from lichen.lifetime import die_with_parent, spawn

if TYPE_CHECKING:
    from lichen.config.engine_config import EngineConfig

SGLANG_PREFIX = "--sglang-"

# SGLang flag -> the lichen flag (or rule) that sets it on every launched server. Aliases listed separately.
LICHEN_SETS: dict[str, str] = {
    "--model-path": "--hf-checkpoint",
    "--model": "--hf-checkpoint",
    "--tokenizer-path": "--hf-checkpoint (its tokenizer)",
    "--host": "lichen (launched engines bind 127.0.0.1)",
    "--port": "lichen (a free port per engine)",
    "--tp-size": "--rollout-num-gpus-per-engine",
    "--tensor-parallel-size": "--rollout-num-gpus-per-engine",
    "--base-gpu-id": "lichen (engine i starts at GPU i * --rollout-num-gpus-per-engine)",
    "--random-seed": "--seed",
    "--dtype": "--bf16 (bfloat16; float32 without it, the trainer's dtype)",
    "--api-key": "lichen (launched engines get a fresh random key per run)",
    "--admin-api-key": "lichen (launched engines get a fresh random key per run)",
}
# Set only when the lichen flag is given; otherwise passed through like any other flag.
LICHEN_SETS_WHEN_GIVEN: dict[str, str] = {
    "--max-running-requests": "--rollout-max-batch-size",
}


class SGLangLaunchError(UserError):
    """An SGLang server did not start (its log tail is in the message)."""


def given_gpus() -> list[str] | None:
    """The GPUs lichen was given, as engines number them (CUDA_VISIBLE_DEVICES, else every GPU the machine has);
    None without CUDA (a CPU run: nothing to place)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        count = torch.cuda.device_count()
    except ImportError:  # pragma: no cover - lichen always has torch
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [d.strip() for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(count)]


def sglang_flag(token: str) -> str:
    """`--sglang-mem-fraction-static=0.7` -> `--mem-fraction-static`."""
    return "--" + token.split("=", 1)[0][len(SGLANG_PREFIX) :]


def check_passthrough(tokens: Sequence[str], max_batch_size: int | None = None) -> None:
    """Raise ConfigError for a pass-through flag that sets what lichen sets (see LICHEN_SETS); `max_batch_size`
    is --rollout-max-batch-size, which sets --max-running-requests when given."""
    given_by_lichen = {"--max-running-requests": max_batch_size}
    for token in tokens:
        if not token.startswith(SGLANG_PREFIX):
            continue
        name = sglang_flag(token)
        if name == "--":
            raise ConfigError(f"{token!r}: expected --sglang-<flag>, e.g. --sglang-mem-fraction-static 0.7")
        given = token.split("=", 1)[0]
        if name in LICHEN_SETS:
            raise ConfigError(f"{given}: lichen sets SGLang's {name} itself from {LICHEN_SETS[name]}; drop {given}")
        if name in LICHEN_SETS_WHEN_GIVEN and given_by_lichen[name] is not None:
            raise ConfigError(f"{given} and {LICHEN_SETS_WHEN_GIVEN[name]} both set SGLang's {name}; give only one")


def translate_passthrough(tokens: Sequence[str]) -> list[str]:
    """`--sglang-<flag>` -> `--<flag>`; values and everything else verbatim."""
    return ["--" + t[len(SGLANG_PREFIX) :] if t.startswith(SGLANG_PREFIX) else t for t in tokens]


def build_sglang_command(
    cfg: EngineConfig, *, engine_index: int, port: int, host: str = "127.0.0.1", python: str | None = None
) -> list[str]:
    """The exact command that starts engine `engine_index` of EngineConfig `cfg` (see the module docstring)."""
    passthrough = list(cfg.passthrough)
    check_passthrough(passthrough, cfg.max_batch_size)
    tp = int(cfg.gpus_per_engine)
    cmd = [
        python or sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(cfg.model_path),
        "--host",
        host,
        "--port",
        str(port),
        "--tp-size",
        str(tp),
        "--base-gpu-id",
        str(engine_index * tp),
        "--random-seed",
        str(cfg.seed),
        "--dtype",
        cfg.sglang_dtype,
    ]
    given = {sglang_flag(t) for t in passthrough if t.startswith(SGLANG_PREFIX)}
    if cfg.memory_saver and "--enable-memory-saver" not in given:
        cmd.append("--enable-memory-saver")
    if cfg.max_batch_size is not None:
        cmd += ["--max-running-requests", str(cfg.max_batch_size)]
    return cmd + translate_passthrough(passthrough)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (SGLang cannot report a port it picked itself, unlike lichen serve)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# `python -c THIS ARGS...` runs `python -m sglang.launch_server ARGS... --api-key K` with the key taken from (and
# removed from) its environment: SGLang reads its key only from argv, and the argv given to exec is what every
# local user sees in `ps`; changing sys.argv inside the process is not. One key: without an admin key SGLang
# takes it on every endpoint, which spares lichen knowing which paths each SGLang release counts as admin ones.
_WITH_KEYS = (
    "import os, runpy, sys\n"
    f"sys.argv += ['--api-key', os.environ.pop({SERVE_KEY_ENV!r})]\n"
    "runpy.run_module('sglang.launch_server', run_name='__main__', alter_sys=True)\n"
)


def keyed_command(cmd: list[str]) -> list[str]:
    """`[python, -m, sglang.launch_server, ARGS...]` -> the same server started through _WITH_KEYS."""
    if cmd[1:3] != ["-m", "sglang.launch_server"]:
        raise ValueError(f"a keyed SGLang launch needs `python -m sglang.launch_server ...`, got {cmd[:3]}")
    return [cmd[0], "-c", _WITH_KEYS, *cmd[3:]]


# Runs in the child before SGLang: die with the parent (argv[1] = its pid), then become the server.
def _stop_if_alive(ref: "weakref.ref[SGLangLauncher]") -> None:
    launcher = ref()
    if launcher is not None:
        launcher.stop()


class _Server:
    def __init__(self, proc: subprocess.Popen, url: str, cmd: list[str], log_path: str):
        self.proc, self.url, self.cmd, self.log_path = proc, url, cmd, log_path


class SGLangLauncher(ServerSet):
    """K SGLang servers; `command_for(i, port) -> argv` builds engine i's command (build_sglang_command).

    `log_dir/engine_{i}.log` receives each server's stdout and stderr (appended across restarts). `gpus`: the GPUs
    lichen was given (given_gpus()) and `gpus_per_engine` N, for the check that an added engine i has its GPUs
    i*N .. i*N+N-1 (None: nothing to place). `keyed`: give the servers a fresh random API key, through their environment (see keyed_command), never on their command
    line; `api_key` is what clients send (`admin_api_key` stays None: SGLang then takes the key everywhere).
    Subclasses for other servers (lichen.engines.clients.vllm_launcher) change the class attributes below and `keyed`."""

    backend = "sglang"  # as --rollout-engine-backend names it, for messages
    ready_path = "/health_generate"  # answers 200 once the server generates
    key_env = SERVE_KEY_ENV  # the environment variable the server's key travels in

    def __init__(
        self,
        command_for: Any,
        num_engines: int,
        *,
        log_dir: str,
        host: str = "127.0.0.1",
        ready_timeout: float = 1800.0,
        env: dict | None = None,
        poll: float = 1.0,
        keyed: bool = False,
        gpus: list[str] | None = None,
        gpus_per_engine: int = 1,
    ):
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        self.command_for, self.num_engines, self.host = command_for, num_engines, host
        self.log_dir, self.ready_timeout, self.poll = log_dir, ready_timeout, poll
        self.env = dict(env or {})
        self.gpus, self.gpus_per_engine = gpus, gpus_per_engine
        self.api_key = self.admin_api_key = None
        if keyed:
            self.api_key = new_key()
            self.env[self.key_env] = self.api_key
        self.servers: list[_Server] = []
        self._lock = threading.Lock()
        self._stopped = False
        atexit.register(_stop_if_alive, weakref.ref(self))

    @classmethod
    def from_config(cls, cfg: EngineConfig, **kwargs: Any) -> "SGLangLauncher":
        """The launcher of `cfg.num_engines` SGLang servers of EngineConfig `cfg`, keyed per run."""

        def command_for(i: int, port: int) -> list[str]:
            return build_sglang_command(cfg, engine_index=i, port=port)

        kwargs.setdefault("keyed", True)
        kwargs.setdefault("gpus", given_gpus())
        log_dir = cfg.log_dir or tempfile.mkdtemp(prefix="lichen-sglang-logs-")  # a run always has one
        return cls(command_for, cfg.num_engines, log_dir=log_dir, gpus_per_engine=int(cfg.gpus_per_engine), **kwargs)

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> list[str]:
        """Start every server and wait until each answers /health_generate; on failure stop all and raise."""
        try:
            self.servers = [self._spawn(i) for i in range(self.num_engines)]
            end = time.monotonic() + self.ready_timeout
            for s in self.servers:
                self._wait_ready(s, end)
        except BaseException:
            self.stop()
            raise
        return self.urls

    def _spawn(self, i: int) -> _Server:
        port = free_port(self.host)
        cmd = self.command_for(i, port)
        os.makedirs(self.log_dir, exist_ok=True)
        log_path = os.path.join(self.log_dir, f"engine_{i}.log")
        argv = self.keyed(cmd) if self.api_key else cmd
        argv = die_with_parent(argv)  # started from the spawner thread: restarts die with the parent too
        # SGLang logs its server_args, the key among them: the log is readable by this user only
        with os.fdopen(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as out:
            out.write(f"\n[lichen] starting: {' '.join(cmd)}\n".encode())
            out.flush()
            env = {**os.environ, **self.env}
            proc = spawn(
                lambda: subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
            )
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return _Server(proc, f"http://{shown}:{port}", cmd, log_path)

    def keyed(self, cmd: list[str]) -> list[str]:
        """The argv that starts `cmd` with the key taken from the environment (see keyed_command)."""
        return keyed_command(cmd)

    def _wait_ready(self, s: _Server, end: float) -> None:
        while True:
            if s.proc.poll() is not None:
                raise SGLangLaunchError(
                    f"--rollout-engine-backend {self.backend}: a server exited with code "
                    f"{s.proc.returncode}: {' '.join(s.cmd)}\n{_tail(s.log_path)}"
                )
            if _answers_200(s.url + self.ready_path):
                self.warm_up(s, end)
                return
            if time.monotonic() > end:
                raise SGLangLaunchError(
                    f"--rollout-engine-backend {self.backend}: {s.url} did not answer {self.ready_path} "
                    f"within {self.ready_timeout:g} s: {' '.join(s.cmd)}\n{_tail(s.log_path)}"
                )
            time.sleep(self.poll)

    def warm_up(self, s: _Server, end: float) -> None:
        """Work a server must have done before it is ready (SGLang's ready path already generates: nothing)."""

    def restart(self, i: int) -> str:
        """Kill engine i (its whole process group) and start it again; returns its new URL once it is ready."""
        with self._lock:
            if self._stopped:
                raise SGLangLaunchError(f"the {self.backend} launcher is stopped")
            _kill_group(self.servers[i].proc, grace=0.0)  # dead or hung: no graceful shutdown to wait for
            self.servers[i] = new = self._spawn(i)
        self._wait_ready(new, time.monotonic() + self.ready_timeout)
        return new.url

    def add(self) -> str:
        """Start one more server (engine index len(servers), e.g. for a `launch` line of the run's engine control
        file) with the same command builder; returns its URL once it is ready. A start that fails leaves nothing
        running and raises SGLangLaunchError with the log tail. Blocking (call it from a worker thread)."""
        with self._lock:
            if self._stopped:
                raise SGLangLaunchError(f"cannot add an engine: the {self.backend} launcher is stopped")
            index = len(self.servers)
            self._check_gpus(index)
            new = self._spawn(index)
            self.servers.append(new)
        try:
            self._wait_ready(new, time.monotonic() + self.ready_timeout)
        except BaseException:
            with self._lock:  # out of the list too: engine i must stay the pool's engine i (restart(i))
                _kill_group(new.proc, grace=0.0)
                self.servers.remove(new)
            raise
        self.num_engines = len(self.servers)
        return new.url

    def _check_gpus(self, index: int) -> None:
        """SGLangLaunchError when engine `index` would need GPUs beyond those lichen was given: its command would
        name devices that do not exist (SGLang's --base-gpu-id, vLLM's CUDA_VISIBLE_DEVICES slice), or lead it
        onto GPUs another engine holds."""
        if self.gpus is None:
            return
        per = self.gpus_per_engine
        need = range(index * per, (index + 1) * per)
        if need.stop <= len(self.gpus):
            return
        names = ", ".join(f"#{g}" for g in need)
        given = ",".join(self.gpus) or "none"
        raise SGLangLaunchError(
            f"cannot add {self.backend} engine {index}: it would need GPU(s) {names} of those lichen was given "
            f"(engine i takes i*{per} .. i*{per}+{per - 1}, --rollout-num-gpus-per-engine {per}), but lichen was "
            f"given {len(self.gpus)} ({given}) and engines 0..{index - 1} hold them: none are free; start the run "
            "with more GPUs visible, or start the engine yourself and add its address"
        )

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM every server's process group, SIGKILL after `grace` s. Idempotent."""
        with self._lock:
            self._stopped = True
            for s in self.servers:
                _kill_group(s.proc, grace)

    # ---- information --------------------------------------------------------------------------------------
    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]


def _kill_group(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM the process group `proc` leads, wait up to `grace` s, then SIGKILL it (at once when grace is 0)."""
    steps = ((signal.SIGTERM, grace),) if grace > 0 else ()
    for sig, wait in steps + ((signal.SIGKILL, 30.0),):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(wait)
            if sig == signal.SIGTERM:  # the leader is gone; make sure its children are too
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            return
        except subprocess.TimeoutExpired:
            continue


def _answers_200(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _tail(path: str, size: int = 2000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-size:]
    except OSError:
        return ""
