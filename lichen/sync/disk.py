"""Full weight sync through the file system (`--update-weight-transport disk --update-weight-mode full`).

Sync to version N:
1. the trainer's weights (`trainer.named_weights()`, as the in-process copy sends them) are written as an HF
   checkpoint to `DIR/weight_v{N:06d}/` with `save_hf_checkpoint`: written beside it and renamed into place, so an
   engine never sees a half-written version; config.json and the tokenizer files come from --hf-checkpoint.
   Under --runtime ray the trainer ranks write it together (`push_from`): each rank the tensors it owns (a
   partition by size), in files of at most --update-weight-buffer-size, streamed as its shards arrive
   (lichen.weights.rank_full); this process writes the index and the side files and renames it into place;
2. every engine loads it: pause generation -> flush cache -> /update_weights_from_disk {model_path, weight_version
   "N"} -> continue generation (RemoteEngines.update_weights_from_disk);
3. every engine must then report weight version "N" (else StaleEngineError);
4. older `weight_v*` directories in DIR are deleted, unless --update-weight-disk-keep-files.

DIR must be readable by the servers under the same path (same machine, or a shared file system), and under
--runtime ray writable by every trainer rank under that path.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any, Callable, Iterable

import torch

from lichen.weights.hf_io import INDEX_FILE, _header_metadata, _write_json, save_hf_checkpoint, write_side_files
from lichen.weights.versions import install_version, list_versions, version_dir, version_tmp_dir
from lichen.weights.wire import dtype_name


def write_version(named_weights: Iterable, root: str, version: int, hf_checkpoint: str) -> str:
    """Write the weights as `root/weight_v{version:06d}` (atomically) from this process; returns that path."""
    path = version_dir(os.path.abspath(root), int(version))
    with open(os.path.join(hf_checkpoint, "config.json")) as f:
        config = json.load(f)
    state = {name: tensor for name, tensor in named_weights}
    save_hf_checkpoint(
        state, path, config=config, copy_files_from=hf_checkpoint, metadata={"weight_version": str(version)}
    )
    return path


def remove_other_versions(root: str, keep: int) -> list[str]:
    """Delete the `weight_v*` directories in `root` other than version `keep`; returns what was deleted.
    Only directories named exactly like a version are touched."""
    removed = []
    for version in list_versions(root):
        if version != int(keep):
            path = version_dir(root, version)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def push_full(
    trainer: Any,
    engines: list,
    version: int,
    *,
    disk_dir: str,
    hf_checkpoint: str,
    keep_files: bool = False,
    post_write_hook: Callable[[str], None] | None = None,
    write: Callable[[], str] | None = None,
) -> dict:
    """Publish the trainer's weights as version `version` to every engine through `disk_dir`; returns metrics.
    `write()`, when given, writes the version instead (the trainer's ranks do, FullDiskSync.push_from) and
    returns its path."""
    from lichen.sync import StaleEngineError

    t0 = time.perf_counter()
    if write is not None:
        path = write()
    else:
        path = write_version(trainer.named_weights(), disk_dir, version, hf_checkpoint)
    if post_write_hook is not None:
        post_write_hook(path)
    t1 = time.perf_counter()
    for engine in engines:
        engine.update_weights_from_disk(path, str(version))
    t2 = time.perf_counter()
    stale = [(i, e.weight_version) for i, e in enumerate(engines) if e.weight_version != str(version)]
    if stale:
        raise StaleEngineError(
            f"engines {[i for i, _ in stale]} report weight versions {[v for _, v in stale]} "
            f"after loading {path!r} as version {version}"
        )
    if not keep_files:
        remove_other_versions(disk_dir, version)
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    return {
        "time/sync": time.perf_counter() - t0,
        "time/sync_write": t1 - t0,
        "time/sync_load": t2 - t1,
        "time/sync_publish": t1 - t0,
        "time/sync_apply": t2 - t1,
        "sync/weight_version": version,
        "sync/bytes": size,
    }


class FullDiskSync:
    """push_full as a transport object (lichen.sync keeps one per RemoteEngines). The checkpoint is written in
    the engine dtype, so the bytes on disk are the bytes the engines serve."""

    def __init__(
        self,
        engines: Any,
        *,
        disk_dir: str,
        hf_checkpoint: str,
        keep_files: bool = False,
        post_write_hook: Callable[[str], None] | None = None,
        buffer_size: int = 512 * 1024**2,
    ):
        self.engines, self.disk_dir, self.hf_checkpoint = engines, disk_dir, hf_checkpoint
        self.keep_files, self.post_write_hook, self.buffer_size = keep_files, post_write_hook, int(buffer_size)
        self.sent_checksums: dict[str, str] = {}

    def push_from(self, sender: Any, version: int, dtype: torch.dtype) -> dict:
        """The version written by the trainer ranks together, each the tensors it owns (about model / ranks bytes,
        streamed into its own files as its shards arrive: lichen.weights.rank_full); this process writes the index,
        config.json and the tokenizer files, renames the directory into place and makes the engines' calls. No
        tensor passes through it. The checksums of what the ranks wrote go to `sent_checksums`."""
        root = os.path.abspath(self.disk_dir)
        metadata = {"weight_version": str(version)}
        done: dict[str, Any] = {}

        def write() -> str:
            tmp = version_tmp_dir(root, version)
            try:
                part = sender.call("write_full", tmp, dtype_name(dtype), self.buffer_size, _header_metadata(metadata))
                index = {"metadata": {"total_size": part["total_bytes"], **metadata}, "weight_map": part["weight_map"]}
                _write_json(os.path.join(tmp, INDEX_FILE), index)
                write_side_files(tmp, config=None, copy_files_from=self.hf_checkpoint)  # its config.json too
                path = install_version(tmp, root, version)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            done.update(part)
            return path

        m = self._push(None, version, write)
        self.sent_checksums = dict(done["sums"])
        m["sync/publish_ranks"] = done["ranks"]
        m["time/sync_publish_ranks"] = done["write_s"]  # the slowest rank's gathers and writes
        return m

    def _push(self, trainer: Any, version: int, write: Callable[[], str] | None = None) -> dict:
        m = push_full(
            trainer,
            [self.engines],
            version,
            disk_dir=self.disk_dir,
            hf_checkpoint=self.hf_checkpoint,
            keep_files=self.keep_files,
            post_write_hook=self.post_write_hook,
            write=write,
        )
        m.pop("time/sync", None)
        m["sync/total_bytes"] = m["sync/bytes"]
        return m

    def push(self, named: Iterable, version: int, dtype: torch.dtype) -> dict:
        def cast():
            for name, t in named:
                yield name, (t.detach().to(dtype) if t.is_floating_point() else t.detach())

        class _Trainer:
            named_weights = staticmethod(cast)

        self.sent_checksums = {}  # verify hashes the trainer's weights itself
        return self._push(_Trainer(), version)
