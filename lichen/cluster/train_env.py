"""The trainer actors' Ray runtime_env: `--train-env-vars`, and torch_memory_saver's preload hook with
`--offload-train` on CUDA.

torch_memory_saver pauses the trainer's GPU memory (weights, optimizer state, everything allocated) while the
engines generate, keeping a CPU copy, and resumes it before training. Its allocation hook must be loaded before
the process starts: `LD_PRELOAD` of the package's `torch_memory_saver_hook_mode_preload*.so` in the actor's
runtime_env, as slime does (importing the package later fails its check); `TMS_INIT_ENABLE=1` puts every
allocation of the process under the saver from the start, `TMS_INIT_ENABLE_CPU_BACKUP=1` keeps the contents
across a pause. `NCCL_CUMEM_ENABLE=0` as slime sets it next to SGLang (which sets it so): NCCL's own cuMem
allocations and the hook's must not mix. A user's own value of any of these (`--train-env-vars`) is kept; their
`LD_PRELOAD` is kept after the hook. The package is the `gpu` extra (`pip install 'lichen[gpu]'`).

`train_runtime_env` is a pure function (tests/test_ray_train_env.py checks what it builds); `memory_saver_hook`
finds the library on the driver (CUDA machines only); lichen.train.memory_saver pauses and resumes in the ranks.
"""

from __future__ import annotations

from typing import Mapping

from lichen.errors import ConfigError
from lichen.train.memory_saver import HOOK_STEM


def memory_saver_hook() -> str:
    """The path of torch_memory_saver's preload library built for this machine's CUDA; ConfigError when the package
    is missing or has no such library."""
    try:
        from torch_memory_saver.utils import get_binary_path_from_package
    except ImportError:
        raise ConfigError(
            "--offload-train with --runtime ray on CUDA pauses the trainer's memory with "
            "torch_memory_saver, which is not installed: pip install 'lichen[gpu]'"
        ) from None
    try:
        return str(get_binary_path_from_package(HOOK_STEM))
    except RuntimeError as e:  # no CUDA runtime found, or not exactly one library for it
        raise ConfigError(
            f"--offload-train: torch_memory_saver has no {HOOK_STEM} library for this machine ({e}); "
            "reinstall it (pip install 'lichen[gpu]') or drop --offload-train"
        ) from None


def train_runtime_env(train_env_vars: Mapping[str, str], memory_saver_lib: str | None = None) -> dict:
    """The trainer actors' runtime_env: the user's `--train-env-vars`, plus the memory saver's hook when
    `memory_saver_lib` (memory_saver_hook()) is given; {} when there is nothing to set."""
    env = dict(train_env_vars)
    if memory_saver_lib:
        env["LD_PRELOAD"] = ":".join(p for p in (memory_saver_lib, env.get("LD_PRELOAD")) if p)
        env.setdefault("TMS_INIT_ENABLE", "1")
        env.setdefault("TMS_INIT_ENABLE_CPU_BACKUP", "1")
        env.setdefault("NCCL_CUMEM_ENABLE", "0")
    return {"env_vars": env} if env else {}
