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

Under `--runtime ray` (`push_from`) the trainer ranks publish: this process decides each version's kind (full or
delta, by the same rules as VersionPublisher) and its chain, each rank encodes and writes the tensors it owns into
the version's temporary directory (lichen.weights.rank_delta), and this process writes the index last and renames
the directory into place. No tensor passes through it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from typing import Any, Callable, Iterable

import torch

from lichen.weights.delta_codec import COMPRESSION_FORMAT
from lichen.weights.hf_io import INDEX_FILE, _write_json, write_side_files
from lichen.weights.rank_send import sent_dtype
from lichen.weights.versions import (
    VersionPublisher,
    delete_versions,
    install_version,
    list_versions,
    remove_stale_versions,
    version_tmp_dir,
)
from lichen.weights.wire import dtype_name


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
        self.options: dict[str, Any] = dict(
            mode=mode,
            encoding=encoding,
            checksum_format=checksum_format,
            full_interval=full_interval or 0,
            keep_files=keep_files,
            post_write_hook=post_write_hook,
        )
        self.publisher: VersionPublisher | None = None
        # the chain the ranks publish under --runtime ray: {"id", "last", "sig", "deltas", "dtype"} or None
        self.chain: dict[str, Any] | None = None
        self.sent_checksums: dict[str, str] = {}

    def _publisher(self, dtype: torch.dtype) -> VersionPublisher:
        if self.publisher is None or self.publisher.dtype != dtype:
            self.publisher = VersionPublisher(
                self.disk_dir, dtype=dtype, config=self._config(), copy_files_from=self.hf_checkpoint, **self.options
            )
        return self.publisher

    def _config(self) -> dict | None:
        """The checkpoint's config.json, which full versions carry (None without one)."""
        if self.hf_checkpoint and os.path.isfile(os.path.join(self.hf_checkpoint, "config.json")):
            with open(os.path.join(self.hf_checkpoint, "config.json")) as f:
                return json.load(f)
        return None

    def reset(self) -> None:
        """The next sync publishes a full version and starts a new chain."""
        if self.publisher is not None:
            self.publisher.reset()
        self.chain = None

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
        self.sent_checksums = {}  # verify hashes the trainer's weights itself
        return self._deliver(version, metrics, t0)

    def push_from(self, sender: Any, version: int, dtype: torch.dtype) -> dict:
        """Version `version` published by the trainer ranks, each encoding the tensors it owns; this process
        decides the kind, writes the index and makes the engines' calls. The checksums of what the ranks
        published go to `sent_checksums`."""
        t0 = time.perf_counter()
        meta = sender.call("meta", all_ranks=False)
        sig = [[row[0], list(row[1]), sent_dtype(row[2], dtype)] for row in meta]
        args = (dtype_name(dtype), self.options["encoding"], self.options["checksum_format"])
        if version == 0:  # nothing published: the engines' own checkpoint; the ranks still say what they hold
            part = sender.call("delta_part", "", "hash", 0, "", *args)
            self.sent_checksums = dict(part["sums"])
            return self._deliver(version, {"sync/bytes": 0, "sync/is_delta": 0}, t0)
        try:
            metrics = self._publish_from(sender, sig, version, args)
        except BaseException:
            self.reset()  # a rank's snapshot may have moved: the next version is full
            raise
        return self._deliver(version, metrics, t0)

    def _full_reason(self, sig: list, version: int, dtype: torch.dtype) -> str:
        c = self.chain
        interval = self.options["full_interval"]
        if self.options["mode"] == "full":
            return "mode full"
        if c is None:
            return "first version of a chain"
        if version != c["last"] + 1:
            return f"version {version} does not follow {c['last']}"
        if interval and c["deltas"] >= interval - 1:
            return f"full interval {interval}"
        if c["sig"] != sig or c["dtype"] != dtype:
            return "tensor names, shapes or dtypes changed"
        return ""

    def _publish_from(self, sender: Any, sig: list, version: int, args: tuple) -> dict:
        dtype = args[0]
        reason = self._full_reason(sig, version, dtype)
        os.makedirs(self.disk_dir, exist_ok=True)
        if self.chain is None:
            self.chain = {"id": uuid.uuid4().hex, "last": None, "sig": sig, "deltas": 0, "dtype": dtype}
            remove_stale_versions(self.disk_dir, version)
        chain = self.chain
        tmp = version_tmp_dir(self.disk_dir, version)
        try:
            kind = "full" if reason else "delta"
            part = sender.call("delta_part", tmp, kind, version, chain["id"], *args)
            meta: dict[str, Any] = {"version": f"{version:06d}"}
            if reason:
                meta.update(total_size=part["total_bytes"])
            else:
                meta.update(
                    base_version=f"{version - 1:06d}",
                    delta_encoding=self.options["encoding"],
                    compression_format=COMPRESSION_FORMAT,
                )
            meta.update(checksum_format=self.options["checksum_format"], chain_id=chain["id"])
            # the ranks' weight maps in the tensors' order: the index reads as one publisher's
            weight_map = {row[0]: part["weight_map"][row[0]] for row in sig if row[0] in part["weight_map"]}
            if reason:
                write_side_files(tmp, config=self._config(), copy_files_from=self.hf_checkpoint)
            _write_json(os.path.join(tmp, INDEX_FILE), {"metadata": meta, "weight_map": weight_map})
            wire = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp))
            final = install_version(tmp, self.disk_dir, version)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        chain.update(last=version, sig=sig, deltas=0 if reason else chain["deltas"] + 1)
        if self.options["post_write_hook"] is not None:
            self.options["post_write_hook"](final)
        if reason and not self.options["keep_files"]:
            delete_versions(self.disk_dir, [v for v in list_versions(self.disk_dir) if v < version])
        self.sent_checksums = dict(part["sums"])
        metrics = {
            "sync/bytes": wire,
            "sync/total_bytes": part["total_bytes"],
            "sync/is_delta": int(not reason),
            "sync/published_tensors": part["published"],
            "sync/publish_ranks": part["ranks"],
            # the slowest rank's gathers (collectives, with every rank) and its encode + write of its own tensors
            "time/sync_publish_gather": part["gather_s"],
            "time/sync_publish_encode": part["write_s"],
        }
        if not reason:
            metrics["sync/changed_density"] = part["changed_bytes"] / max(1, part["total_bytes"])
        return metrics

    def _deliver(self, version: int, metrics: dict[str, Any], t0: float) -> dict:
        """The engines pull version `version` and apply it (steps 2 and 3 of the module doc)."""
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
                "sync/bytes_read": sum(int(p.get("bytes_read", 0) or 0) for p in pulls if p is not None),
            }
        )
        return metrics
