"""Asynchronous checkpoint writes (`--async-save`, the default): the state is copied on the training path, the
files are written off it.

A save with `--async-save` takes a `Snapshot` of what the checkpoint holds (the trainer's tensors copied to CPU
memory, containers rebuilt, plain values kept) and returns; a `BackgroundWrite` thread writes the files, hashes
them and then runs lichen.train.checkpoint.commit (rollout_state.json, meta.json, checksums.json, `latest` last).
So the files are complete before the manifest and `latest` name them, and a process killed during the write
leaves `latest` on the previous checkpoint, as a crash during a synchronous save does.

One write at a time per process: the next save, the end of the run and its error path (lichen.loop) wait for the
one in flight (`wait_for_saves`). A write that failed raises there, as a RunError naming the checkpoint.

Memory: a snapshot costs one copy of the model and optimizer state in CPU memory. The buffers are kept between
saves and reused (copied into, not reallocated) when the next save's tensors have the same names, shapes and
dtypes, which they have in a run: the copy is paid once, the allocation never again.
"""

from __future__ import annotations

import copy
import threading
from typing import Any, Callable

import numpy as np
import torch

from lichen.errors import RunError
from lichen.observe.metrics import get_logger

log = get_logger(__name__)

# Tests set this to a function (stage, rollout_id) called by the writing thread (by the training thread when the
# save is synchronous) at "start" (before any file is written) and at "files" (the trainer's files written, before
# the manifest and `latest`): a hook can block the write or end the process there. None in a run.
WRITE_HOOK: Callable[[str, int], None] | None = None


class Snapshot:
    """CPU copies of nested dicts/lists/tuples of tensors and plain values, into buffers kept for the next take.

    `take(tree)` returns a tree of the same shape (and the same sharing: one object reached twice gives one copy
    reached twice, so torch.save pickles the copy exactly as it pickles the original) whose tensors are CPU copies
    and whose containers are new, so nothing the trainer later changes in place reaches the copy."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._on_cuda = False

    def take(self, tree: Any) -> Any:
        memo: dict[int, Any] = {}
        used: set[tuple] = set()
        self._on_cuda = False
        out = self._copy(tree, (), memo, used)
        if self._on_cuda:  # the copies were queued non-blocking: they are done before the trainer goes on
            torch.cuda.synchronize()
        for stale in set(self._buffers) - used:  # a tensor gone since the last save: its buffer goes too
            del self._buffers[stale]
        return out

    @property
    def nbytes(self) -> int:
        """The CPU memory the kept buffers hold."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def _copy(self, value: Any, path: tuple, memo: dict[int, Any], used: set[tuple]) -> Any:
        if id(value) in memo:
            return memo[id(value)]
        if isinstance(value, torch.Tensor):
            out: Any = self._tensor(value, path, used)
        elif isinstance(value, dict):
            # a shallow copy keeps the class and its attributes (a module state_dict is an OrderedDict with
            # `_metadata`, which torch.save pickles too); then its values are replaced by their copies
            out = copy.copy(value)
            memo[id(value)] = out
            for k, v in value.items():
                out[k] = self._copy(v, (*path, k), memo, used)
            return out
        elif isinstance(value, list):
            out = [self._copy(v, (*path, i), memo, used) for i, v in enumerate(value)]
        elif type(value) is tuple:
            out = tuple(self._copy(v, (*path, i), memo, used) for i, v in enumerate(value))
        else:  # ints, floats, strings, None: immutable, kept as they are
            return value
        memo[id(value)] = out
        return out

    def _tensor(self, t: torch.Tensor, path: tuple, used: set[tuple]) -> torch.Tensor:
        used.add(path)
        t = t.detach()
        buf = self._buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.stride() != t.stride():
            # t's own strides where it is contiguous: the bytes torch.save and safetensors write are t's; pinned
            # memory for a CUDA tensor, so the copy does not stage through a pageable bounce buffer
            pin = t.is_cuda
            if t.is_contiguous():
                buf = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu", pin_memory=pin)
            else:
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            self._buffers[path] = buf
        if t.device.type == "cpu" and t.is_contiguous() and buf.is_contiguous():
            _copy_bytes(buf, t)
        else:
            buf.copy_(t, non_blocking=t.is_cuda)
            self._on_cuda = self._on_cuda or t.is_cuda
        return buf


def _copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst` = `src` (contiguous CPU tensors of one shape and dtype) as one single-threaded memcpy. torch's copy_
    splits a large copy over its intra-op threads, which on a loaded CPU wait on each other: 240 MB took 0.1-0.4 s
    with 2 threads against 0.03-0.07 s with one (measured at load average 15-25 on 2 cores)."""
    np.copyto(dst.reshape(-1).view(torch.uint8).numpy(), src.reshape(-1).view(torch.uint8).numpy())


class BackgroundWrite:
    """One checkpoint's files, written and committed by a thread; `wait` joins it and raises what it raised."""

    def __init__(self, rollout_id: int, write: Callable[[], None]):
        self.rollout_id = rollout_id
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(write,), name=f"lichen-ckpt-{rollout_id}")
        self._thread.start()

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
        except BaseException as e:  # kept for `wait`, which raises it in the thread that waits
            self.error = e

    def wait(self) -> None:
        self._thread.join()
        if self.error is not None:
            e = self.error
            raise RunError(
                f"checkpoint {self.rollout_id}: writing it failed ({type(e).__name__}: {e}); it was not committed, "
                "the previous checkpoint stays the one --load resumes"
            ) from e


_lock = threading.Lock()
_pending: BackgroundWrite | None = None


def hook(stage: str, rollout_id: int) -> None:
    """Call the test hook (WRITE_HOOK) at `stage` of the write of checkpoint `rollout_id`, if one is set."""
    if WRITE_HOOK is not None:
        WRITE_HOOK(stage, rollout_id)


def start(rollout_id: int, write: Callable[[], None]) -> None:
    """Run `write` (the files and commit of checkpoint `rollout_id`) in the background, after the write in flight."""
    global _pending
    wait_for_saves()
    with _lock:
        _pending = BackgroundWrite(rollout_id, write)


def wait_for_saves(*, raise_errors: bool = True) -> None:
    """Wait for the checkpoint write in flight, if any (its files, manifest and `latest` are on disk when this
    returns). A failed write raises RunError; with raise_errors=False (a run already failing) it is logged."""
    global _pending
    with _lock:
        pending, _pending = _pending, None
    if pending is None:
        return
    try:
        pending.wait()
    except RunError as e:
        if raise_errors:
            raise
        log.error("%s", e)
