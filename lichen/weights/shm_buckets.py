"""Buckets of tensors in memory another process on this host can map, and their handles (SGLang's
`serialized_named_tensors`): the primitives of the `tensor` weight transport, used by the trainer ranks' senders
(lichen.weights.rank_send) and by the driver's half (lichen.sync.tensor_handles, which says how the transport
works).

- CUDA tensors: shared by CUDA IPC handle, the device written as the GPU's UUID instead of its index (as SGLang's
  `monkey_patch_torch_reductions` does, so a receiver whose CUDA_VISIBLE_DEVICES numbers the GPUs differently maps
  it back). Untested without a GPU.
- CPU tensors: one uint8 bucket in POSIX shared memory by *file name* (`/dev/shm/torch_*`, torch's `file_system`
  strategy), since an unrelated process cannot receive a file descriptor from us; each tensor a view of it. The
  bucket is allocated shared first and the weights are cast into it, so pickling copies nothing. It must fit in
  /dev/shm's free space, checked before it is written: a full tmpfs kills the writer with SIGBUS instead of raising.
"""

from __future__ import annotations

import base64
import io
import os
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from torch.multiprocessing import reductions

from lichen.errors import ConfigError
from lichen.weights.wire import dtype_name

CUDA_DEVICE_ARG = 6  # index of the device in rebuild_cuda_tensor's arguments (stable across torch releases)
ALIGN = 64  # each tensor's offset in a bucket: any dtype's view of the uint8 bucket is aligned
SHM_DIR = "/dev/shm"


def _reduce_cpu_storage(storage: torch.UntypedStorage) -> tuple:
    """torch's file_system reduction, whatever this process's sharing strategy: the storage is mapped by name
    (the default file_descriptor strategy needs a socket to our own process, which an engine cannot open)."""
    if storage.size() == 0:
        return reductions.rebuild_storage_empty, (type(storage),)
    manager, handle, size = storage._share_filename_cpu_()  # already shared: returns its name, copies nothing
    storage._shared_incref()  # the receiver's rebuild releases this reference
    return reductions.rebuild_storage_filename, (type(storage), manager, handle, size)


def _reduce_tensor(t: torch.Tensor) -> tuple:
    fn, args = reductions.reduce_tensor(t)
    if t.is_cuda:  # the GPU's UUID, not this process's index of it
        uuid = str(torch.cuda.get_device_properties(args[CUDA_DEVICE_ARG]).uuid)
        args = (*args[:CUDA_DEVICE_ARG], uuid, *args[CUDA_DEVICE_ARG + 1 :])
    return fn, args


_OVERRIDES = {
    torch.UntypedStorage: _reduce_cpu_storage,
    torch.Tensor: _reduce_tensor,
    torch.nn.Parameter: _reduce_tensor,
}


class _HandlePickler(ForkingPickler):
    """ForkingPickler with tensors reduced as above (its own dispatch table: no global strategy change)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)  # sets this instance's dispatch table from the registered reducers
        self.dispatch_table.update(_OVERRIDES)


def serialize(named: Any) -> str:
    """One `serialized_named_tensors` entry: the handles of `named` (a list of (name, tensor) pairs, or any object
    holding tensors), pickled and base64-encoded."""
    buf = io.BytesIO()
    _HandlePickler(buf, pickle.HIGHEST_PROTOCOL).dump(named)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def shm_free_bytes(path: str = SHM_DIR) -> int | None:
    """Bytes still free in the shared-memory file system (None where there is none to ask)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def alloc_bucket(
    specs: list[tuple[str, list[int], torch.dtype]],
    dtype: torch.dtype,
    device: torch.device,
    pool: BucketPool | None = None,
) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """One flat uint8 tensor with room for the tensors `specs` ((name, shape, trainer dtype)) in `dtype` (floating
    ones; others keep theirs), in shared memory on CPU (a spare of `pool` where one is large enough), unwritten;
    returns it and the (name, view of it) pairs."""
    from lichen.weights.rank_send import engine_nbytes_of  # (rank_send imports this module where it sends)

    sizes = [engine_nbytes_of(shape, dtype_name(src), dtype) for _, shape, src in specs]
    total = sum(_aligned(size) for size in sizes)
    flat = pool.reuse(total, shared=True) if pool is not None and device.type == "cpu" else None
    if flat is None and device.type == "cpu":
        check_shm_room(total)
        flat = shm_empty(total)
    elif flat is None:
        flat = torch.empty(total, dtype=torch.uint8, device=device)
    return flat, bucket_views(flat, specs, dtype)


def check_shm_room(nbytes: int) -> None:
    """A ConfigError naming the flag unless /dev/shm has `nbytes` free: writing past a full tmpfs kills the
    process (SIGBUS) instead of raising."""
    free = shm_free_bytes()
    if free is not None and nbytes > free:
        raise ConfigError(
            f"--update-weight-transport tensor: a bucket of {nbytes} bytes does not fit in {SHM_DIR} ({free} bytes "
            "free); lower --update-weight-buffer-size (a tensor larger than it still needs its own size there) "
            "or give the machine more shared memory (docker: --shm-size)"
        )


def shm_empty(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes`, unwritten, whose storage is a /dev/shm file from the start (torch's
    file_system strategy, the one `_share_filename_cpu_` moves a storage to). Made there directly: `torch.empty`
    followed by `_share_filename_cpu_()` first allocated and faulted private memory and then copied it over."""
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_using_filename_cpu(nbytes))


class BucketPool:
    """The CPU memory of one sync's buckets, reused from bucket to bucket. A new /dev/shm file costs several times
    the copy into it (the kernel allocates and zeroes every page at its first write: on this project's 2-core
    machine 0.10-0.15 s for 127 MB against 0.03 s for the copy), which every bucket used to pay.

    `reuse(n, shared)` returns the first n bytes of a spare bucket of that kind (in /dev/shm or private memory)
    that is large enough, else None (the caller allocates); `give(bucket)` makes a CPU bucket nobody reads any more
    a spare of its kind (at most `keep`; the smallest goes first); `clear()` frees them, at the end of a sync, so nothing stays
    allocated between syncs. Only the caller knows when a bucket is no longer read (an engine answered, a
    broadcast completed): reusing it earlier would change bytes a reader still uses."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self._spares: list[tuple[bool, torch.Tensor]] = []

    def reuse(self, nbytes: int, shared: bool) -> torch.Tensor | None:
        for i, (kind, t) in enumerate(self._spares):
            if kind == shared and t.numel() >= nbytes:
                del self._spares[i]
                return t[:nbytes]
        return None

    def give(self, bucket: torch.Tensor) -> None:
        if bucket.device.type != "cpu":  # CUDA memory: torch's caching allocator already reuses it
            return
        whole = bucket if bucket._base is None else bucket._base  # the allocation, not the view of it
        self._spares.append((whole.untyped_storage().is_shared(), whole))
        self._spares.sort(key=lambda kt: -kt[1].numel())
        del self._spares[self.keep :]

    def clear(self) -> None:
        self._spares.clear()

    def __len__(self) -> int:
        return len(self._spares)


def bucket_views(
    flat: torch.Tensor, specs: list[tuple[str, list[int], torch.dtype]], dtype: torch.dtype
) -> list[tuple[str, torch.Tensor]]:
    """The (name, view) pairs of the tensors `specs` in the bucket `flat` (alloc_bucket's layout): what another
    process that maps the same bucket writes into."""
    from lichen.weights.rank_send import engine_nbytes_of

    views, off = [], 0
    for name, shape, src in specs:
        size = engine_nbytes_of(shape, dtype_name(src), dtype)
        want = dtype if src.is_floating_point else src
        views.append((name, flat[off : off + size].view(want).view(tuple(int(d) for d in shape))))
        off += _aligned(size)
    return views


def open_bucket(handle: str) -> torch.Tensor:
    """The bucket whose handle `serialize([("bucket", flat)])` made, mapped in this process (another trainer rank
    on the same host: a trusted peer, so plain unpickling)."""
    return pickle.loads(base64.b64decode(handle))[0][1]


def fill_bucket(
    bucket: list[tuple[str, torch.Tensor]], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """One flat uint8 tensor holding `bucket` cast to `dtype` (floating tensors), in shared memory on CPU; returns
    it and the (name, view of it) pairs to serialize."""
    flat, views = alloc_bucket([(n, list(t.shape), t.dtype) for n, t in bucket], dtype, device)
    for (_, t), (_, view) in zip(bucket, views):
        view.copy_(t.detach())
    return flat, views
