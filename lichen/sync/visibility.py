"""The start checks of the disk and tensor transports: every engine can read the sync directory the trainer writes
versions into (disk), or this host's shared memory (tensor: it maps segments by name there).

The driver writes a probe file with a random token in `--update-weight-disk-dir`, and every engine, on its own
node, reads it back under the same path; an engine that cannot open it, or reads other content (a directory of
the same name on its own disk, not the shared one), stops the run at its first sync with one line naming the
directory and the engine. The comparison is by content: two Ray nodes can share an IP (two raylets on one host),
and the same path can exist on two machines, so neither an address nor the path's existence proves the
directory is shared.

Engines that can be asked are those whose launcher has `read_each(path)` -> [{"content" | "error", "where"}]
per engine (lichen.cluster.engine_actors: each engine's Ray actor reads the file on its node). Servers this process launched itself share its file system;
external servers (`--rollout-external-engine-addrs`) cannot be asked and are not checked.
"""

from __future__ import annotations

import os
import secrets
from typing import Any

from lichen.errors import ConfigError
from lichen.observe.metrics import get_logger

log = get_logger(__name__)

PROBE_PREFIX = ".lichen-probe-"  # not a `weight_v*` name: version listings never see it


DISK_ADVICE = (
    "give a directory that every engine's node shares under the same path (a shared file system), or "
    "use --update-weight-transport nccl"
)


def check_dir_visible(
    engines: Any, directory: str | None, flag: str = "--update-weight-disk-dir", advice: str = DISK_ADVICE
) -> int:
    """Raise ConfigError unless every engine of `engines` (a RemoteEngines) reads, by content, a probe file written
    in `directory` now; returns how many engines were asked (0: none can be, see the module doc)."""
    read_each = getattr(getattr(engines, "launcher", None), "read_each", None)
    if read_each is None or not directory:
        return 0
    root = os.path.abspath(directory)
    os.makedirs(root, exist_ok=True)
    token = secrets.token_hex(16)
    path = os.path.join(root, PROBE_PREFIX + token)
    with open(path, "w", encoding="utf-8") as f:
        f.write(token)
    try:
        seen = read_each(path)
    finally:
        os.remove(path)
    for i, s in enumerate(seen):
        if s.get("content") == token:
            continue
        what = s.get("error") or "it read other content: a directory of that name on its own node, not this one"
        raise ConfigError(
            f"{flag} {directory}: engine {i} ({s.get('where', '?')}) cannot read the probe file {path} that lichen "
            f"wrote there ({what}); {advice}"
        )
    log.info("%s %s: visible to all %d engines (each read the probe file back)", flag, directory, len(seen))
    return len(seen)


def check_same_host(engines: Any, shm_dir: str = "/dev/shm") -> int:
    """The tensor transport's start check: every engine reads back a probe file in this host's shared memory
    (`shm_dir`), so it can map the segments the handles name. Two Ray raylets on one host pass (they share it);
    an engine on another machine reads nothing there. Skipped where the directory does not exist."""
    if not os.path.isdir(shm_dir):
        return 0
    return check_dir_visible(
        engines,
        shm_dir,
        "--update-weight-transport tensor",
        "the engines must run on the trainer's host (colocated) to map its memory; use "
        "--update-weight-transport nccl or disk for engines on other nodes",
    )
