"""torch_memory_saver in a trainer rank (CUDA, `--offload-train`, `--runtime ray`): is its preload hook in this
process, and pausing / resuming the rank's GPU memory through it by region tag.

lichen.cluster.train_env puts the hook in the trainer actors' runtime_env; with it, every allocation of the
process is under the saver from the start (TMS_INIT_ENABLE=1) with a CPU copy kept across a pause, tagged with the
library's default tag. The rank allocates two things in tagged regions instead (`TaggedMemory.region`):

- `weights`: the FSDP shards of the policy, reference and teacher models (allocated when the models are sharded);
- `optimizer`: what optimizer steps allocate (the AdamW moments, created at the first step);
- everything else stays `default`: activations, gradients, the PPO critic, communication buffers, caches.

The loop's order (docs/architecture.md#offload) then becomes, per rank:
  offload: synchronize + empty the cache, pause default, pause optimizer, pause weights;
  onload:  resume weights, resume optimizer, resume default;
  a weight read while offloaded (the sync after `trainer.offload()` gathers the full weights): resume weights,
  read them with the saver disabled (the gather's temporaries come from a fresh pool, never from a paused
  segment), synchronize, pause weights again.
Paused memory comes back at the same addresses (no tensor moves, unlike lichen.train.offload's copies).

The library cannot open a region inside another, and with TMS_INIT_ENABLE the whole process already is one, so a
tagged region is opened inside `disable()` (which closes the process-wide one for its duration), as slime does
for its own allocations outside the default region. The backend is an object with `region`, `disable`, `pause`,
`resume` and `synchronize`: `LibraryBackend` on CUDA, `RecordingBackend` on CPU, where the same calls are
recorded instead and tests/test_memory_saver.py checks their order. Untested without a GPU: the library itself.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Mapping

HOOK_STEM = "torch_memory_saver_hook_mode_preload"  # the library's file name starts so

WEIGHTS, OPTIMIZER, DEFAULT = "weights", "optimizer", "default"  # DEFAULT: the library's own tag
PAUSE_ORDER = (DEFAULT, OPTIMIZER, WEIGHTS)  # what training needs least goes first
RESUME_ORDER = tuple(reversed(PAUSE_ORDER))


def memory_saver_active(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a process with environment `environ` (default: this one) was started with the saver's hook."""
    env = os.environ if environ is None else environ
    preload = env.get("LD_PRELOAD", "")
    return env.get("TMS_INIT_ENABLE") == "1" and any(HOOK_STEM in p for p in preload.split(":"))


class LibraryBackend:
    """torch_memory_saver itself (CUDA, hook preloaded)."""

    def __init__(self) -> None:
        from torch_memory_saver import torch_memory_saver

        self.tms = torch_memory_saver

    @contextlib.contextmanager
    def region(self, tag: str) -> Iterator[None]:
        with self.tms.disable(), self.tms.region(tag=tag, enable_cpu_backup=True):
            yield

    def disable(self) -> Any:
        return self.tms.disable()

    def pause(self, tag: str) -> None:
        self.tms.pause(tag)

    def resume(self, tag: str) -> None:
        self.tms.resume(tag)

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()  # no kernel may still read what is paused
        torch.cuda.empty_cache()  # no cached free block of a paused segment is handed out later


class RecordingBackend:
    """The same calls, recorded as strings (CPU: nothing to release)."""

    def __init__(self, calls: list[str] | None = None) -> None:
        self.calls: list[str] = [] if calls is None else calls

    @contextlib.contextmanager
    def region(self, tag: str) -> Iterator[None]:
        self.calls.append(f"region({tag})")
        yield
        self.calls.append(f"end region({tag})")

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        self.calls.append("disable")
        yield
        self.calls.append("end disable")

    def pause(self, tag: str) -> None:
        self.calls.append(f"pause({tag})")

    def resume(self, tag: str) -> None:
        self.calls.append(f"resume({tag})")

    def synchronize(self) -> None:
        self.calls.append("synchronize")


class TaggedMemory:
    """One rank's tagged pause/resume; with `backend` None (no hook in this process) every call is a no-op and
    `active` is False (the rank then offloads by copies, lichen.train.offload)."""

    def __init__(self, backend: Any = None):
        self.backend = backend
        self.paused = False

    @property
    def active(self) -> bool:
        return self.backend is not None

    def region(self, tag: str) -> Any:
        """Allocations inside are tagged `tag`."""
        return self.backend.region(tag) if self.active else contextlib.nullcontext()

    def tag_optimizer(self, optimizer: Any) -> None:
        """Every step of `optimizer` runs in the `optimizer` region, so the state it creates is tagged so."""
        if not self.active:
            return
        open_regions: list = []

        def enter(*_: Any) -> None:
            ctx = self.region(OPTIMIZER)
            ctx.__enter__()
            open_regions.append(ctx)

        def leave(*_: Any) -> None:
            open_regions.pop().__exit__(None, None, None)

        optimizer.register_step_pre_hook(enter)
        optimizer.register_step_post_hook(leave)

    def offload(self) -> None:
        if not self.active or self.paused:
            return
        self.backend.synchronize()
        for tag in PAUSE_ORDER:
            self.backend.pause(tag)
        self.paused = True

    def onload(self) -> None:
        if not self.active or not self.paused:
            return
        for tag in RESUME_ORDER:
            self.backend.resume(tag)
        self.paused = False

    @contextlib.contextmanager
    def weights_resident(self) -> Iterator[None]:
        """Inside, the weights are on the device even while offloaded (the sync reads them after
        `trainer.offload()`); the rest stays paused."""
        if not self.active or not self.paused:
            yield
            return
        self.backend.resume(WEIGHTS)
        try:
            with self.backend.disable():
                yield
        finally:
            self.backend.synchronize()
            self.backend.pause(WEIGHTS)


def for_this_process() -> TaggedMemory:
    """The rank's TaggedMemory: the library's when the hook is preloaded, else inactive."""
    return TaggedMemory(LibraryBackend() if memory_saver_active() else None)
