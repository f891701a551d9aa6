"""torch_memory_saver in a trainer rank (CUDA, `--offload-train`, `--runtime ray`): is its preload hook in this
process, and pausing / resuming all of the process's GPU memory through it.

lichen.cluster.train_env puts the hook in the trainer actors' runtime_env; with it, every allocation of the
process is under the saver from the start (TMS_INIT_ENABLE=1) with a CPU copy kept across a pause, so `pause`
frees the GPU memory of weights, gradients, optimizer state and caches at once and `resume` brings it back at the
same addresses (no tensor moves, unlike lichen.train.offload's copies). Untested without a GPU.
"""

from __future__ import annotations

import os
from typing import Mapping

HOOK_STEM = "torch_memory_saver_hook_mode_preload"  # the library's file name starts so


def memory_saver_active(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a process with environment `environ` (default: this one) was started with the saver's hook."""
    env = os.environ if environ is None else environ
    preload = env.get("LD_PRELOAD", "")
    return env.get("TMS_INIT_ENABLE") == "1" and any(HOOK_STEM in p for p in preload.split(":"))


def pause() -> None:
    import torch
    from torch_memory_saver import torch_memory_saver

    torch.cuda.synchronize()  # no kernel may still read what is paused
    torch_memory_saver.pause()


def resume() -> None:
    from torch_memory_saver import torch_memory_saver

    torch_memory_saver.resume()
