"""Checkpoint integrity: the checksum manifest of a checkpoint, its verification, and stale temp-entry cleanup.

`checksums.json` in `iter_N/` lists every file of the checkpoint with its size and xxh3-128 digest:
    {"format": 1, "algorithm": "xxh3_128", "files": {"hf/model.safetensors": {"size": 1234, "xxh3_128": "…"}, …}}
It is written after every other file of the checkpoint (and before `latest_checkpointed_iteration.txt`), so a
checkpoint without it is unfinished — or was written by a lichen from before checksums. `verify` checks every
listed file (size first, then digest), so truncation, a zeroed file and a single flipped bit are all caught
before anything is loaded. Entries named `*.tmp-PID` / `*.old-PID` (an unfinished atomic write) are neither
listed nor verified; `remove_stale_temps` deletes those whose owning process is gone.

A checkpoint directory is untrusted input (it may come from elsewhere, or a local user may plant files in it), and
lichen never saves a symlink or a special file into one. So every file read for a check is opened by
`open_inside` (lichen.safe_files): only a regular file inside the directory, every link resolved; reads stop at
the size the manifest (or a cap) allows. A planted link to a file outside cannot make a message reveal that file's size, and
a FIFO, /dev/zero or /proc/self/pagemap cannot hang a load or fill its memory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import BinaryIO

import xxhash

from lichen import safe_files
from lichen.errors import ConfigError

MANIFEST = "checksums.json"
ALGORITHM = "xxh3_128"
FORMAT = 1
NO_MANIFEST = "missing: the save did not finish, or an older lichen (before checkpoint checksums) wrote it"
_CHUNK = 8 << 20
MAX_MANIFEST_BYTES = 64 << 20  # a manifest lists a few hundred bytes per file; thousands of shards fit easily
_TEMP_ENTRY = re.compile(r"\.(tmp|old)-(\d+)$")  # what atomic writes name their temp files and directories


class CheckpointDamaged(ConfigError):
    """A checkpoint file that is missing, truncated, altered or unreadable; `path` is relative to the checkpoint."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def file_digest(path: str) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def open_inside(root: str, rel: str) -> BinaryIO:
    """`root`/`rel` opened for reading if it is a regular file inside `root` (lichen.safe_files), else
    CheckpointDamaged naming `rel`."""
    try:
        return safe_files.open_inside(root, rel)
    except safe_files.UnsafeFile as e:
        raise CheckpointDamaged(rel, str(e)) from None


def read_inside(root: str, rel: str, max_bytes: int) -> bytes:
    """The contents of the regular file `root`/`rel`, at most `max_bytes` (lichen.safe_files), else
    CheckpointDamaged naming `rel`."""
    try:
        return safe_files.read_inside(root, rel, max_bytes)
    except safe_files.UnsafeFile as e:
        raise CheckpointDamaged(rel, str(e)) from None


def _checked_digest(f: BinaryIO, size: int) -> str | None:
    """The digest of `f`'s contents, None when it holds more than `size` bytes (never reads more than size + 1)."""
    h = xxhash.xxh3_128()
    left = size + 1
    while left > 0 and (chunk := f.read(min(_CHUNK, left))):
        h.update(chunk)
        left -= len(chunk)
    return h.hexdigest() if left > 0 else None


def checkpoint_files(directory: str) -> list[str]:
    """Relative paths ('/'-separated, sorted) of the files a manifest of `directory` covers: all but the manifest
    itself and temp entries of unfinished atomic writes."""
    out = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not _TEMP_ENTRY.search(d))
        rel_root = os.path.relpath(root, directory)
        for name in files:
            rel = name if rel_root == "." else f"{rel_root}/{name}".replace(os.sep, "/")
            if rel != MANIFEST and not _TEMP_ENTRY.search(name):
                out.append(rel)
    return sorted(out)


def file_entries(directory: str, rels: list[str]) -> dict[str, dict]:
    """The manifest entries (size, digest) of the files `rels` of the checkpoint in `directory`."""
    return {
        rel: {
            "size": os.path.getsize(os.path.join(directory, rel)),
            ALGORITHM: file_digest(os.path.join(directory, rel)),
        }
        for rel in rels
    }


def write_manifest(directory: str, files: dict[str, dict] | None = None) -> None:
    """Write `checksums.json` atomically (fsynced) listing `files` (file_entries; the ranks of a sharded save hash
    their shares), by default every file of the checkpoint in `directory`, hashed here."""
    if files is None:
        files = file_entries(directory, checkpoint_files(directory))
    atomic_write_text(
        os.path.join(directory, MANIFEST),
        json.dumps({"format": FORMAT, "algorithm": ALGORITHM, "files": files}, indent=1, sort_keys=True),
    )


def atomic_write_text(path: str, text: str) -> None:
    """Write `path` as a whole or not at all: a sibling `<path>.tmp-<pid>`, fsynced, renamed into place."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def remove_manifest(directory: str) -> None:
    """Mark `directory` unfinished before files in it are rewritten (a crash mid-save must not look complete)."""
    try:
        os.remove(os.path.join(directory, MANIFEST))
    except FileNotFoundError:
        pass


def _read_manifest(directory: str) -> dict:
    if not os.path.lexists(os.path.join(directory, MANIFEST)):
        raise CheckpointDamaged(MANIFEST, NO_MANIFEST)
    try:
        manifest = json.loads(read_inside(directory, MANIFEST, MAX_MANIFEST_BYTES).decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointDamaged(MANIFEST, f"unreadable ({str(e)[:200]})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (manifest.get("algorithm") if isinstance(manifest, dict) else None) != ALGORITHM or not isinstance(files, dict):
        raise CheckpointDamaged(MANIFEST, f"not a lichen checksum manifest (expected format {FORMAT}, {ALGORITHM})")
    for rel, entry in files.items():
        if (
            os.path.isabs(rel)
            or ".." in rel.split("/")
            or not isinstance(entry, dict)
            or not isinstance(entry.get("size"), int)
            or not isinstance(entry.get(ALGORITHM), str)
        ):
            raise CheckpointDamaged(MANIFEST, f"damaged entry {rel!r}")
    return files


def verify(directory: str, *, part: tuple[int, int] = (0, 1)) -> None:
    """Raise `CheckpointDamaged` naming the first file of the checkpoint in `directory` that does not match its
    manifest (missing, wrong size, wrong digest), or a weight file under hf/ that the manifest does not list.
    `part` (k, n): check only every n-th listed file from the k-th, the unlisted files in part 0 (n ranks share
    the work of one check)."""
    files = _read_manifest(directory)
    k, n = part
    for rel in sorted(files)[k::n]:
        with open_inside(directory, rel) as f:  # a regular file inside the checkpoint, or CheckpointDamaged
            size = os.fstat(f.fileno()).st_size
            if size != files[rel]["size"]:
                raise CheckpointDamaged(
                    rel, f"truncated or overwritten: {size} bytes, the save wrote {files[rel]['size']}"
                )
            digest = _checked_digest(f, size)
        if digest is None:
            raise CheckpointDamaged(rel, f"holds more than the {size} bytes its size says; refused")
        if digest != files[rel][ALGORITHM]:
            raise CheckpointDamaged(rel, "checksum mismatch: its contents changed after the save (disk error or edit)")
    # The weight loader reads whatever index/shards it finds in hf/: a file added there would be loaded unchecked.
    extra = [rel for rel in checkpoint_files(directory) if rel.startswith("hf/") and rel not in files] if k == 0 else []
    if extra:
        raise CheckpointDamaged(extra[0], "not in the checkpoint's checksums (added after the save)")


def _process_start_time(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch), from /proc; None where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/stat") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _owner_may_be_writing(pid: int, mtime: float) -> bool:
    """Whether the process that named a temp entry after itself may still be writing it.

    This process never is (saves run one at a time; a leftover with our pid is an earlier process's). A dead pid
    never is. A live pid is, unless it started after the entry was last modified: then it is a newer process that
    reused the number (containers restart runs with the same small pids).
    """
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    started = _process_start_time(pid)
    return started is None or started <= mtime + 1.0


def remove_stale_temps(save_dir: str) -> list[str]:
    """Delete the temp files/directories (`*.tmp-PID`, `*.old-PID`) that crashed saves left in `save_dir` and its
    `iter_*` checkpoints, never one whose owner may still be writing it; returns the paths removed."""
    if not os.path.isdir(save_dir):
        return []
    parents = [save_dir] + [
        os.path.join(save_dir, d)
        for d in sorted(os.listdir(save_dir))
        if d.startswith("iter_") and os.path.isdir(os.path.join(save_dir, d))
    ]
    removed = []
    for parent in parents:
        for name in os.listdir(parent):
            m = _TEMP_ENTRY.search(name)
            path = os.path.join(parent, name)
            if m is None:
                continue
            try:
                if _owner_may_be_writing(int(m.group(2)), os.lstat(path).st_mtime):
                    continue
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)
            except FileNotFoundError:  # its owner finished meanwhile
                continue
            removed.append(path)
    return removed
