"""Launches vLLM servers for `--rollout-engine-backend vllm --rollout-num-engines K` (docs/engines.md).

vLLM cannot share lichen's environment (it pins its own torch and transformers), so it runs from its own
interpreter: `--vllm-python PATH`, else $LICHEN_VLLM_PYTHON, else `.venv-vllm/bin/python` beside lichen's source
tree (what `scripts/setup_vllm.sh` creates). Engine i runs

    VLLM_SERVER_DEV_MODE=1 VLLM_API_KEY=KEY PYTHONPATH=<scratch>/path VLLM_RPC_BASE_PATH=<scratch>/rpc \\
    PYTHON -m vllm.entrypoints.openai.api_server --model CKPT --host 127.0.0.1 --port P_i --seed SEED
        --dtype DTYPE --tensor-parallel-size N --logprobs-mode processed_logprobs --generation-config vllm
        --enable-scale-out --middleware lichen.engines.clients.vllm_guard.KeyGuard [--max-num-seqs M]
        [--kv-cache-memory-bytes B] PASS-THROUGH...

- what lichen sets (LICHEN_SETS) comes from its own flags, as for SGLang (lichen.engines.clients.sglang_launcher), plus
  what lichen's rollout relies on: `processed_logprobs` (the log-prob of the sampled token under the temperature
  the sample was drawn at: lichen's convention, docs/architecture.md#log-prob-convention; vLLM's default is T = 1),
  `--generation-config vllm` (the checkpoint's generation_config.json must not change a request's sampling), the
  token-in/token-out endpoint `/inference/v1/generate` (`--enable-scale-out`) and the key guard;
- on a machine without CUDA, `--kv-cache-memory-bytes` is 512 MiB unless `--vllm-kv-cache-memory-bytes` or
  `--vllm-gpu-memory-utilization` is given (vLLM's CPU default reserves 92 % of the machine's memory);
- with several engines, engine i sees GPUs i*N .. i*N+N-1 (CUDA_VISIBLE_DEVICES, within the one lichen was given),
  an engine added mid-run (`add()`) too;
- every other `--vllm-<flag> [VALUE...]` is passed through verbatim as `--<flag> [VALUE...]`.

The key: vLLM reads VLLM_API_KEY from its environment (never its command line, which every local user sees), and
lichen's KeyGuard (lichen.engines.clients.vllm_guard) extends it from vLLM's /v1, /inference paths to the control plane.
The server is ready when `GET /health` answers 200 and a first generate with log-probs came back (`VLLMLauncher.warm_up`:
vLLM compiles its log-prob gather on that request). Process groups, restart and stop: SGLangLauncher's.

The launcher owns one scratch directory (`<tmp>/lichen-vllm-*`): `path/` links lichen's package (`lichen_path_dir`),
`rpc/` holds the ZMQ sockets vLLM's API server and engine core talk over (VLLM_RPC_BASE_PATH), `tmp/` is the
servers' TMPDIR (vLLM's distributed-init files, multiprocessing's directories). vLLM leaves all of these behind: one
socket file per channel, one `vllm_dist_*` file per engine; a thousand test runs left thousands of files in /tmp.
`stop()` removes the directory (and so does the launcher's end without `stop()`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from typing import TYPE_CHECKING, Any, Callable, Sequence

import lichen
from lichen.engines.clients.sglang_launcher import SGLangLauncher, SGLangLaunchError, _Server, _tail, given_gpus
from lichen.engines.clients.vllm_client import GENERATE, vllm_generate_body

# the receiver of weight syncs (lichen.sync.vllm_sync) and where it may load checkpoints from
from lichen.engines.clients.vllm_worker_ext import RECEIVER, WEIGHT_DIRS_ENV
from lichen.errors import ConfigError

if TYPE_CHECKING:
    from lichen.config.engine_config import EngineConfig

VLLM_PREFIX = "--vllm-"
PYTHON_ENV = "LICHEN_VLLM_PYTHON"
KEY_ENV = "VLLM_API_KEY"  # read by vLLM itself and by lichen.engines.clients.vllm_guard
GUARD = "lichen.engines.clients.vllm_guard.KeyGuard"
CPU_KV_CACHE_BYTES = 512 * 1024 * 1024
INSTALL_HINT = "create vLLM's environment with scripts/setup_vllm.sh (docs/engines.md), or name its python"

_FIXED = "lichen (its rollout needs it: docs/engines.md)"
LICHEN_SETS: dict[str, str] = {
    "--model": "--hf-checkpoint",
    "--tokenizer": "--hf-checkpoint (its tokenizer)",
    "--host": "lichen (launched engines bind 127.0.0.1)",
    "--port": "lichen (a free port per engine)",
    "--tensor-parallel-size": "--rollout-num-gpus-per-engine",
    "--tp": "--rollout-num-gpus-per-engine",
    "--seed": "--seed",
    "--dtype": "--bf16 (bfloat16; float32 without it, the trainer's dtype)",
    "--api-key": "lichen (launched engines get a fresh random key per run)",
    "--logprobs-mode": _FIXED,
    "--generation-config": _FIXED,
    "--middleware": "lichen (its key guard of the control plane)",
    "--enable-sleep-mode": "--offload-rollout",
    "--served-model-name": "lichen (the checkpoint's path)",
    "--worker-extension-cls": "lichen (its weight-sync receiver, lichen.engines.clients.vllm_worker_ext)",
}
# Set only when the lichen flag is given; otherwise passed through like any other flag.
LICHEN_SETS_WHEN_GIVEN: dict[str, str] = {"--max-num-seqs": "--rollout-max-batch-size"}
# Any of these given: lichen leaves vLLM's memory sizing on CPU to them.
MEMORY_FLAGS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization")
CHUNKING_FLAGS = ("--max-num-batched-tokens", "--enable-chunked-prefill", "--no-enable-chunked-prefill")


class VLLMLaunchError(ConfigError):
    """A vLLM server could not be started as configured (no interpreter, a flag lichen sets)."""


def vllm_flag(token: str) -> str:
    """`--vllm-max-model-len=512` -> `--max-model-len`."""
    return "--" + token.split("=", 1)[0][len(VLLM_PREFIX) :]


def check_passthrough(tokens: Sequence[str], max_batch_size: int | None = None) -> None:
    """ConfigError for a `--vllm-<flag>` that sets what lichen sets (LICHEN_SETS)."""
    for token in tokens:
        if not token.startswith(VLLM_PREFIX):
            continue
        name, given = vllm_flag(token), token.split("=", 1)[0]
        if name == "--":
            raise ConfigError(f"{token!r}: expected --vllm-<flag>, e.g. --vllm-max-model-len 2048")
        if name in LICHEN_SETS:
            raise ConfigError(f"{given}: lichen sets vLLM's {name} itself from {LICHEN_SETS[name]}; drop {given}")
        if name in LICHEN_SETS_WHEN_GIVEN and max_batch_size is not None:
            raise ConfigError(f"{given} and {LICHEN_SETS_WHEN_GIVEN[name]} both set vLLM's {name}; give only one")


def translate_passthrough(tokens: Sequence[str]) -> list[str]:
    """`--vllm-<flag>` -> `--<flag>`; values verbatim."""
    return ["--" + t[len(VLLM_PREFIX) :] if t.startswith(VLLM_PREFIX) else t for t in tokens]


def default_python() -> str:
    """`.venv-vllm/bin/python` beside lichen's source tree (the repository root of an editable install)."""
    return os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(lichen.__file__))), ".venv-vllm", "bin", "python"
    )


def resolve_python(flag_value: str | None) -> str:
    """The interpreter of vLLM's environment: --vllm-python, else $LICHEN_VLLM_PYTHON, else default_python();
    ConfigError (one line, with the install hint) when it is not an executable file."""
    for value, source in ((flag_value, "--vllm-python"), (os.environ.get(PYTHON_ENV), f"${PYTHON_ENV}")):
        if value:
            path = shutil.which(value) or value
            if not (os.path.isfile(path) and os.access(path, os.X_OK)):
                raise ConfigError(f"{source} {value}: not an executable file; {INSTALL_HINT}")
            return os.path.abspath(path)
    path = default_python()
    if not os.access(path, os.X_OK):
        raise ConfigError(
            f"--rollout-engine-backend vllm: no vLLM environment at {path}; {INSTALL_HINT} with --vllm-python "
            f"PATH or ${PYTHON_ENV}"
        )
    return path


def _cuda_here() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:  # pragma: no cover - lichen always has torch
        return False


def build_vllm_command(cfg: EngineConfig, *, port: int, host: str = "127.0.0.1", python: str) -> list[str]:
    """The command that starts one vLLM engine of EngineConfig `cfg` (see the module docstring)."""
    passthrough = list(cfg.passthrough)
    check_passthrough(passthrough, cfg.max_batch_size)
    given = {vllm_flag(t) for t in passthrough if t.startswith(VLLM_PREFIX)}
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(cfg.model_path),
        "--host",
        host,
        "--port",
        str(port),
        "--seed",
        str(cfg.seed),
        "--dtype",
        cfg.sglang_dtype,
        "--tensor-parallel-size",
        str(int(cfg.gpus_per_engine)),
        "--logprobs-mode",
        "processed_logprobs",
        "--generation-config",
        "vllm",
        "--enable-scale-out",
        "--middleware",
        GUARD,
        "--worker-extension-cls",
        RECEIVER,
    ]
    if cfg.max_batch_size is not None:
        cmd += ["--max-num-seqs", str(cfg.max_batch_size)]
    if cfg.memory_saver:  # --offload-rollout: /sleep and /wake_up (refused on CPU at start, lichen.config.vllm_config)
        cmd += ["--enable-sleep-mode"]
    if not _cuda_here() and not given.intersection(MEMORY_FLAGS):
        cmd += ["--kv-cache-memory-bytes", str(CPU_KV_CACHE_BYTES)]
    if not _cuda_here() and not given.intersection(CHUNKING_FLAGS):
        # vLLM 0.32's CPU build crashes its engine core on a seeded request whose prompt is prefilled in chunks (it
        # rewinds the request's generator with set_offset, which CPU generators lack). Chunks come from a long
        # prompt or from a step's token budget running out mid-prompt (many prompts at once): no chunked prefill
        # then (vLLM raises its step budget to the longest prompt, max_model_len, itself).
        cmd += ["--no-enable-chunked-prefill"]
    return cmd + translate_passthrough(passthrough)


def engine_gpus(index: int, per_engine: int, visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES of engine `index`: its slice of the devices lichen may use."""
    devices = visible.split(",") if visible else [str(i) for i in range((index + 1) * per_engine)]
    return ",".join(devices[index * per_engine : (index + 1) * per_engine])


def lichen_path_dir(scratch: str) -> str:
    """`scratch/path`, a new directory holding only a link to lichen's package: on vLLM's PYTHONPATH it makes the
    modules lichen runs inside vLLM (the key guard; weight-sync worker extensions) importable without the rest of
    lichen's environment, whose packages would shadow vLLM's."""
    path = os.path.join(scratch, "path")
    os.mkdir(path)
    os.symlink(os.path.dirname(os.path.abspath(lichen.__file__)), os.path.join(path, "lichen"))
    return path


class VLLMLauncher(SGLangLauncher):
    """K vLLM servers (SGLangLauncher's process handling; ready once /health answers and a first generate with
    log-probs did (`warm_up`); the key in VLLM_API_KEY)."""

    backend = "vllm"
    ready_path = "/health"
    key_env = KEY_ENV

    scratch: str | None = None  # the directory stop() removes (from_config makes it)
    _remove_scratch: Callable[[], Any] | None = None  # and so does the launcher's end without stop() (a finalizer)

    def keyed(self, cmd: list[str]) -> list[str]:
        return cmd  # vLLM reads its key from the environment itself

    def stop(self, grace: float = 15.0) -> None:
        """Stop every server (SGLangLauncher.stop), then remove the scratch directory and the sockets in it."""
        super().stop(grace)
        if self._remove_scratch is not None:
            self._remove_scratch()

    def warm_up(self, s: _Server, end: float) -> None:
        """One token with its log-prob, asked as rollouts ask. vLLM compiles its log-prob gather (torch.compile,
        even at -O0) on the first such request: seconds on a quiet CPU, over 30 s on a busy one, while the engine
        holds every request and health probe behind it. Done here, that time counts against the ready timeout and
        an engine (launched or restarted) enters rotation answering at its normal speed."""
        body = vllm_generate_body({"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 1.0}})
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(s.url + GENERATE, json.dumps(body).encode(), headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=max(1.0, end - time.monotonic())) as resp:
                resp.read()
        except (urllib.error.URLError, OSError) as e:
            detail = e.read().decode(errors="replace")[:300] if isinstance(e, urllib.error.HTTPError) else ""
            raise SGLangLaunchError(
                f"--rollout-engine-backend vllm: {s.url} answered /health but not its first generate ({GENERATE}, "
                f"one token with its log-prob): {e} {detail}: {' '.join(s.cmd)}\n{_tail(s.log_path)}"
            ) from None

    @classmethod
    def from_config(
        cls, cfg: EngineConfig, *, num_engines: int | None = None, host: str = "127.0.0.1", **kwargs: Any
    ) -> "VLLMLauncher":
        """The launcher of `cfg.num_engines` vLLM servers of EngineConfig `cfg`, keyed per run. `num_engines` /
        `host`: one engine of a Ray engine actor (lichen.cluster.engine_actors), which binds its node's address and
        whose CUDA_VISIBLE_DEVICES the actor sets."""
        python = resolve_python(cfg.vllm_python)
        count = cfg.num_engines if num_engines is None else num_engines
        multi = count > 1
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")

        def command_for(i: int, port: int) -> list[str]:
            cmd = build_vllm_command(cfg, port=port, host=host, python=python)
            # each engine its own GPUs (an added one, i >= count, too: never the first engine's by inheritance);
            # `env` keeps the per-engine variable out of the shared env
            if multi or i > 0:
                cmd = [
                    shutil.which("env") or "/usr/bin/env",
                    f"CUDA_VISIBLE_DEVICES={engine_gpus(i, int(cfg.gpus_per_engine), visible)}",
                    *cmd,
                ]
            return cmd

        scratch = tempfile.mkdtemp(prefix="lichen-vllm-")
        pythonpath = os.pathsep.join(p for p in (lichen_path_dir(scratch), os.environ.get("PYTHONPATH")) if p)
        rpc, tmp = os.path.join(scratch, "rpc"), os.path.join(scratch, "tmp")
        os.mkdir(rpc)
        os.mkdir(tmp)
        # the only directories a server may load weights from (lichen_load_dir), as lichen serve's --weight-dir
        dirs = os.pathsep.join(os.path.abspath(d) for d in (cfg.weight_dir, cfg.local_checkpoint_dir) if d)
        env = {
            "VLLM_SERVER_DEV_MODE": "1",
            "PYTHONPATH": pythonpath,
            "VLLM_RPC_BASE_PATH": rpc,
            "TMPDIR": tmp,
            WEIGHT_DIRS_ENV: dirs,
            **kwargs.pop("env", {}),
        }
        kwargs.setdefault("keyed", True)
        kwargs.setdefault("gpus", given_gpus())  # what an added engine is checked against (SGLangLauncher.add)
        log_dir = kwargs.pop("log_dir", None) or cfg.log_dir or tempfile.mkdtemp(prefix="lichen-vllm-logs-")
        per = int(cfg.gpus_per_engine)
        launcher = cls(command_for, count, log_dir=log_dir, env=env, host=host, gpus_per_engine=per, **kwargs)
        launcher.scratch = scratch
        launcher._remove_scratch = weakref.finalize(launcher, shutil.rmtree, scratch, True)
        return launcher
