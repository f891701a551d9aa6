"""Weight sync by tensor handles for engines on the trainer's host (`--update-weight-transport tensor`).

SGLang's `/update_weights_from_tensor`: the trainer puts each bucket of weights (in the engine dtype, at most
--update-weight-buffer-size bytes) in memory the engines can map, and posts only *handles* to it, serialized as
SGLang's MultiprocessingSerializer does (torch.multiprocessing's reductions pickled, base64), with
`load_format: null`, i.e. a list of (name, tensor) pairs. The engine maps the memory, copies the tensors into its
parameters and answers; only then are the bucket's tensors released (the handles would dangle otherwise).

- CUDA weights: the bucket is one CUDA tensor; torch shares it by CUDA IPC handle. The device is written as the
  GPU's UUID instead of its index (as SGLang's `monkey_patch_torch_reductions` does, so a receiver whose
  CUDA_VISIBLE_DEVICES numbers the GPUs differently maps it back). Untested without a GPU.
- CPU weights: the bucket is one uint8 tensor in POSIX shared memory by *file name* (`/dev/shm/torch_*`, torch's
  `file_system` strategy), since an unrelated process cannot receive a file descriptor from us; each tensor is a
  view of it. The bucket is allocated shared first and the weights are cast into it, so pickling copies nothing
  (a request body is a few hundred bytes per bucket, whatever the bucket's size).

Who writes the buckets: the sender (lichen.sync.senders, lichen.weights.rank_send.RankSender.tensor_bucket). Under
--runtime ray every trainer rank gathers each bucket and the ranks serve the engines' TP ranks in turn (entry j by
rank j mod world size), each from its own shared memory (its own GPU); this process plans the buckets, posts the
handles the ranks answer, and receives no tensor. Locally this process is the only sender.

Every engine gets its own serialization of the same bucket (one per TP rank, as SGLang wants): each adds the
reference that the engine's rebuild releases, so the shared file is unlinked once everyone has closed it. (An
engine that fails before reading its entry leaves that reference: the file then lives until torch's shm manager
cleans up at the trainer's exit.) A CPU bucket must fit in /dev/shm's free space, checked before it is written:
a full tmpfs kills the writer with SIGBUS instead of raising.
"""

from __future__ import annotations

import base64
import io
import os
import pickle
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any, Iterable

import torch
from torch.multiprocessing import reductions

from lichen.errors import ConfigError
from lichen.observe.metrics import get_logger
from lichen.sync.senders import InProcessSender
from lichen.weights.rank_send import engine_nbytes_of, plan_meta_buckets
from lichen.weights.wire import dtype_name

log = get_logger(__name__)

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
    views, off = [], 0
    for (name, shape, src), size in zip(specs, sizes):
        want = dtype if src.is_floating_point else src
        views.append((name, flat[off : off + size].view(want).view(tuple(int(d) for d in shape))))
        off += _aligned(size)
    return flat, views


def fill_bucket(
    bucket: list[tuple[str, torch.Tensor]], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """One flat uint8 tensor holding `bucket` cast to `dtype` (floating tensors), in shared memory on CPU; returns
    it and the (name, view of it) pairs to serialize."""
    flat, views = alloc_bucket([(n, list(t.shape), t.dtype) for n, t in bucket], dtype, device)
    for (_, t), (_, view) in zip(bucket, views):
        view.copy_(t.detach())
    return flat, views


class TensorSync:
    """The trainer's side of the tensor-handle transport for one RemoteEngines (lichen.sync keeps one)."""

    def __init__(self, engines: Any, *, buffer_size: int, timeout_s: float = 600.0):
        self.engines, self.buffer_size, self.timeout_s = engines, int(buffer_size), timeout_s
        self._local = InProcessSender()  # push's sender over this process's tensors
        self.sent_checksums: dict[str, str] = {}

    @staticmethod
    def _bodies(handles: list[str], version: int, tp_sizes: list[int]) -> list[dict]:
        """One request body per engine: its TP ranks' entries of `handles` (each its own serialization, so its own
        reference), in order."""
        bodies, at = [], 0
        for tp in tp_sizes:
            bodies.append(
                {
                    "serialized_named_tensors": handles[at : at + tp],
                    "load_format": None,
                    "flush_cache": False,
                    "weight_version": str(version),
                }
            )
            at += tp
        return bodies

    def push(self, named: Iterable[tuple[str, torch.Tensor]], version: int, dtype: torch.dtype) -> dict:
        """Send the weights as version `version` in the engine dtype from this process (the local trainer's);
        returns metrics (bytes, buckets, seconds)."""
        return self.push_from(self._local.bind(named), version, dtype)

    def push_from(self, sender: Any, version: int, dtype: torch.dtype) -> dict:
        """Send the sender's weights (lichen.sync.senders: the trainer ranks under --runtime ray, each serving the
        engine TP ranks on its device or host) as version `version`, bucket by bucket: the ranks write each bucket
        into their own shared memory and answer handles; this process posts them and receives no tensor. The
        checksums of what was sent are left in `sent_checksums`."""
        meta = sender.call("meta", all_ranks=False)
        if not meta:
            raise ValueError("the trainer has no weights to send")
        t0 = time.perf_counter()
        admit = getattr(self.engines, "admit_restarted", None)
        if admit is not None:
            admit()
        # one /server_info round per version, not per bucket: the engines' TP sizes do not change within a sync
        tp_sizes = [max(1, int(info.get("tp_size") or 1)) for info in self.engines.server_infos()]
        sent = count = body_bytes = 0
        fill_s = 0.0
        sums: dict[str, str] = {}
        try:
            with self.engines.paused():  # paused and flushed once for the whole version, as the broadcast
                for bucket in plan_meta_buckets(meta, dtype, self.buffer_size):
                    names = [row[0] for row in bucket]
                    out = sender.call("tensor_bucket", names, dtype_name(dtype), sum(tp_sizes))
                    fill_s += float(out["fill_s"])
                    sums.update(out["sums"])
                    bodies = self._bodies(out["handles"], version, tp_sizes)
                    body_bytes += sum(len(h) for h in out["handles"])
                    self.engines.post_each("/update_weights_from_tensor", bodies, timeout=self.timeout_s)
                    sent += sum(engine_nbytes_of(row[1], row[2], dtype) for row in bucket)
                    count += 1
        finally:  # only now may the ranks drop their last bucket: every engine has copied it out (or failed)
            sender.call("tensor_release")
        self.sent_checksums = sums
        return {
            "sync/bytes": sent,
            "sync/total_bytes": sent,
            "sync/buckets": count,
            "sync/request_bytes": body_bytes,
            "time/sync_publish": fill_s,
            "time/sync_transfer": time.perf_counter() - t0 - fill_s,
        }
