"""Delta weight sync through the file system (`--update-weight-transport disk --update-weight-mode delta`).

The trainer publishes versions with lichen.weights.VersionPublisher in the engine dtype under
`--update-weight-disk-dir` (format: docs/weight-format.md): the first sync after a start or a resume is a full
version that starts a chain; later ones hold only the changed tensors (xor or overwrite, zstd, per-tensor
checksums); `--update-weight-full-interval N` makes every Nth a full one; versions older than the newest full one
are deleted unless `--update-weight-disk-keep-files`.

One sync to version N (>= 1):
1. publish `weight_v{N:06d}` (time: publish);
2. `/pull_weights {local_checkpoint_dir, source_dir, target_version N}` on every engine (time: transfer): the
   engine brings its host-local copy to N (seeding from the newest full version it needs, checking every
   checksum; a failure leaves the engine serving its last good weights and stops the run); lichen serve also
   decodes the deltas into a staged copy of its weights here;
3. pause -> flush -> `/update_weights_from_disk {model_path: local dir, weight_version "N"}` -> continue
   (time: apply): lichen serve moves its live weights by the deltas (swaps the staged copy in,
   docs/architecture.md#live-delta-apply),
   SGLang reloads the local copy.

Version 0 (the start of a fresh run) publishes nothing: `/pull_weights` target 0 seeds the local copy from the
engine's own checkpoint, as slime's first sync does.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Iterable

import torch

from lichen.weights.versions import VersionPublisher


class DeltaSync:
    """The trainer's side of delta disk sync for one RemoteEngines."""

    def __init__(
        self,
        engines: Any,
        *,
        disk_dir: str,
        local_dir: str,
        hf_checkpoint: str | None = None,
        encoding: str = "xor",
        checksum_format: str = "xxh3-128",
        full_interval: int = 0,
        keep_files: bool = False,
        post_write_hook: Callable[[str], None] | None = None,
        mode: str = "delta",
    ):
        self.engines = engines
        self.disk_dir, self.local_dir = os.path.abspath(disk_dir), os.path.abspath(local_dir)
        self.hf_checkpoint = hf_checkpoint
        self.options = dict(
            mode=mode,
            encoding=encoding,
            checksum_format=checksum_format,
            full_interval=full_interval or 0,
            keep_files=keep_files,
            post_write_hook=post_write_hook,
        )
        self.publisher: VersionPublisher | None = None

    def _publisher(self, dtype: torch.dtype) -> VersionPublisher:
        if self.publisher is None or self.publisher.dtype != dtype:
            config = None
            if self.hf_checkpoint and os.path.isfile(os.path.join(self.hf_checkpoint, "config.json")):
                with open(os.path.join(self.hf_checkpoint, "config.json")) as f:
                    config = json.load(f)
            self.publisher = VersionPublisher(
                self.disk_dir, dtype=dtype, config=config, copy_files_from=self.hf_checkpoint, **self.options
            )
        return self.publisher

    def reset(self) -> None:
        """The next sync publishes a full version and starts a new chain."""
        if self.publisher is not None:
            self.publisher.reset()

    def push(self, named: Iterable[tuple[str, torch.Tensor]], version: int, dtype: torch.dtype) -> dict:
        t0 = time.perf_counter()
        metrics: dict[str, Any] = {}
        if version > 0:
            res = self._publisher(dtype).publish(dict(named), version)
            metrics.update(
                {
                    "sync/bytes": res.wire_bytes,
                    "sync/total_bytes": res.total_bytes,
                    "sync/is_delta": int(res.kind == "delta"),
                    "sync/published_tensors": res.num_published,
                }
            )
            if res.changed_bytes is not None:
                metrics["sync/changed_density"] = res.changed_bytes / max(1, res.total_bytes)
        else:
            metrics.update({"sync/bytes": 0, "sync/is_delta": 0})
        t1 = time.perf_counter()
        try:
            pulls = self.engines.post_each(
                "/pull_weights",
                {"local_checkpoint_dir": self.local_dir, "source_dir": self.disk_dir, "target_version": version},
            )
            t2 = time.perf_counter()
            self.engines.update_weights_from_disk(self.local_dir, str(version))
        except BaseException:
            self.reset()  # an engine may not hold this version: the next sync must not build on it
            raise
        t3 = time.perf_counter()
        metrics.update(
            {
                "time/sync_publish": t1 - t0,
                "time/sync_transfer": t2 - t1,
                "time/sync_apply": t3 - t2,
                "sync/bytes_read": sum(int(p.get("bytes_read", 0) or 0) for p in pulls),
            }
        )
        return metrics
