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
handles the ranks answer, and receives no tensor. Locally this process is the only sender. The buckets and their
handles: lichen.weights.shm_buckets.

Every engine gets its own serialization of the same bucket (one per TP rank, as SGLang wants): each adds the
reference that the engine's rebuild releases, so the shared file is unlinked once everyone has closed it. (An
engine that fails before reading its entry leaves that reference: the file then lives until torch's shm manager
cleans up at the trainer's exit.) A CPU bucket must fit in /dev/shm's free space, checked before it is written:
a full tmpfs kills the writer with SIGBUS instead of raising.
"""

from __future__ import annotations

import time
from typing import Any, Iterable

import torch

from lichen.observe.metrics import get_logger
from lichen.sync.senders import InProcessSender
from lichen.weights.rank_send import engine_nbytes_of, plan_meta_buckets
from lichen.weights.wire import dtype_name

log = get_logger(__name__)


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
