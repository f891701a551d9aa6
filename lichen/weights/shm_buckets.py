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
    specs: list[tuple[str, list[int], torch.dtype]], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """One flat uint8 tensor with room for the tensors `specs` ((name, shape, trainer dtype)) in `dtype` (floating
    ones; others keep theirs), in shared memory on CPU, unwritten; returns it and the (name, view of it) pairs."""
    from lichen.weights.rank_send import engine_nbytes_of  # (rank_send imports this module where it sends)

    sizes = [engine_nbytes_of(shape, dtype_name(src), dtype) for _, shape, src in specs]
    total = sum(_aligned(size) for size in sizes)
    if device.type == "cpu":
        free = shm_free_bytes()
        if free is not None and total > free:  # writing past a full tmpfs kills the process (SIGBUS), not an error
            raise ConfigError(
                f"--update-weight-transport tensor: a bucket of {total} bytes does not fit in {SHM_DIR} ({free} bytes "
                f"free); lower --update-weight-buffer-size (a tensor larger than it still needs its own size there) "
                "or give the machine more shared memory (docker: --shm-size)"
            )
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    if device.type == "cpu":
        flat.untyped_storage()._share_filename_cpu_()  # into /dev/shm before any byte is written
    return flat, bucket_views(flat, specs, dtype)


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
