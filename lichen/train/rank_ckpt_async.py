"""--async-save on the multi-rank trainer: one rank's asynchronous checkpoint write (lichen.train.dist_trainer).

`RankAsyncSave.start` runs on the training path of every rank at once: torch.distributed.checkpoint's
`async_save` stages the rank's shards to CPU memory (a DefaultStager kept for the run: its CPU copies are reused by
the next save, keyed by the source storages, which the optimizer updates in place) and writes them in DCP's
thread; then every rank writes its files of the HF export (hf/: lichen.weights.rank_hf) from the tensors of those
files, gathered into it on the training path. DCP's collectives (planning, the metadata) and the export's small
exchanges run on a gloo group of their own, created by the first save, so they never interleave with the
training's collectives.

`result` (every rank, from the driver's checkpoint thread through the rank actor's "ckpt" concurrency group, so it
never queues behind the training's calls) waits for the rank's write and returns the manifest entries of the files
it hashed: each rank a share of the DCP and hf/ files (every rank's writes are complete once the export's final
exchange has returned on any rank). No collective: the driver merges the shares and commits (meta.json,
checksums.json, `latest`: lichen.train.checkpoint).
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from lichen.train.ckpt_integrity import checkpoint_files, file_entries

METADATA = ".metadata"  # the DCP file the coordinator writes last

# hf_write(group, error): this rank's part of the HF export, its exchanges on `group` (the write's own); `error` a
# failure of this rank's DCP write, which the export reports to every rank instead of writing
HfWrite = Callable[[Any, "str | None"], None]


HOLD_ENV = "LICHEN_TEST_CKPT_HOLD_FILE"  # tests: a rank's write waits (up to HOLD_BOUND_S) for this file to exist
HOLD_BOUND_S = 120.0


def _test_hold() -> None:
    """Where a test holds the rank's write (HOLD_ENV) until the training it runs meanwhile is done; a failure
    bound, then the write fails."""
    path = os.environ.get(HOLD_ENV)
    if not path:
        return
    deadline = time.monotonic() + HOLD_BOUND_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{HOLD_ENV}: {path} never appeared")
        time.sleep(0.05)


class RankAsyncSave:
    """One rank's asynchronous checkpoint writes, one at a time."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self._group: Any = None
        self._stager: DefaultStager | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lichen-rank-ckpt")
        self._pending: concurrent.futures.Future | None = None

    def start(self, state: dict, ckpt_dir: str, dist_dir: str, hf_write: HfWrite | None) -> None:
        """Stage `state` (the rank's DCP state) and write it to `dist_dir` of checkpoint `ckpt_dir` in the
        background, with `hf_write` (this rank's part of the HF export) after it; every rank calls this at once."""
        self.wait()
        if self._group is None:  # collective: every rank's first save creates it
            self._group = dist.new_group(backend="gloo")
        if self._stager is None:
            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda,
                    use_shared_memory=False,
                    use_async_staging=False,
                    use_non_blocking_copy=False,
                )
            )
        response = dcp.async_save(state, checkpoint_id=dist_dir, process_group=self._group, async_stager=self._stager)
        upload = response.upload_completion if isinstance(response, AsyncSaveResponse) else response
        self._pending = self._pool.submit(self._finish, upload, ckpt_dir, dist_dir, hf_write)

    def _finish(
        self, upload: concurrent.futures.Future, ckpt_dir: str, dist_dir: str, hf_write: HfWrite | None
    ) -> dict[str, dict]:
        error = None
        try:
            upload.result()  # every rank's shards and the metadata are written
            _test_hold()
        except Exception as e:
            if hf_write is None:
                raise
            error = f"trainer rank {self.rank}: {type(e).__name__}: {e}"  # the export's exchanges still run
        if hf_write is not None:  # every rank writes its files of hf/ (every rank raises if any rank failed)
            hf_write(self._group, error)
        if not os.path.isfile(os.path.join(dist_dir, METADATA)):
            # a guard: `latest` must never name a checkpoint DCP cannot load (one test run with a rank killed
            # mid-sync was left with a committed checkpoint lacking .metadata; its cause is not found yet)
            raise RuntimeError(f"{dist_dir}/{METADATA} is missing after the write; the checkpoint is not complete")
        top = os.path.relpath(dist_dir, ckpt_dir)
        shards = sorted(f"{top}/{rel}" for rel in checkpoint_files(dist_dir))
        exported = sorted(rel for rel in checkpoint_files(ckpt_dir) if rel.startswith("hf/")) if hf_write else []
        return file_entries(ckpt_dir, (shards + exported)[self.rank :: self.world_size])

    def wait(self) -> None:
        """Wait for the write in flight (its error is raised by `result`, which the driver calls)."""
        if self._pending is not None:
            concurrent.futures.wait([self._pending])

    def result(self) -> dict[str, dict]:
        """The manifest entries this rank hashed for the write in flight, once it is complete; {} if none."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else {}

    def close(self) -> None:
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        self._pool.shutdown(wait=True)
