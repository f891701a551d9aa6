"""The engine side of disk weight sync: bring a host-local checkpoint to a published version (`/pull_weights`).

`pull_weights(local, source, N)` seeds `local` from the newest full version at or below N that it needs, then
applies each later delta in order, in place in the local safetensors files (pread/pwrite), checking every tensor's
checksum. The local directory keeps its state in `<local>/.weight_sync/`, the layout SGLang's own pull uses:
`lock` (a per-host `flock`, so engines sharing the directory serialize and the later ones find nothing to do)
and `state.json` = `{"version": "000007", ...}`, written atomically after a version is complete and removed
before the first in-place write, so a failed pull leaves no claim and the next pull reseeds from a full version.

lichen adds to state.json the version's `chain_id` and the host's boot id: a local copy from another chain (a
resumed run republishing version numbers) or from before a reboot (page-cache writes lost) is reseeded rather
than trusted. A local copy ahead of the target is reseeded too (SGLang treats that as a no-op).

Deltas applied to live tensors instead (an engine that moves its loaded weights rather than reloading):
lichen.weights.live_delta. With a `LiveStage` (lichen.weights.staging) a pull decodes each payload once, into the engine's
staging buffers, checks it there and writes those verified bytes to the local file.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from lichen.weights.delta_codec import (
    ChecksumMismatchError,
    DeltaError,
    VersionMismatchError,
    apply_tensor,
    apply_tensor_at,
    check_checksum_format,
    checksum,
    write_at,
)
from lichen.weights.hf_io import INDEX_FILE
from lichen.weights.live_delta import check_delta_meta, delta_payloads
from lichen.weights.parallel import parallel_map
from lichen.weights.staging import LiveStage
from lichen.weights.versions import VersionInfo, read_safetensors_header, read_version_info, version_dir

SYNC_DIR = ".weight_sync"
_STATE = "state.json"
_LOCK = "lock"
_FILES = "files.json"  # the files of the local dir that a pull wrote: the only ones a pull may replace or delete


@dataclass(frozen=True)
class PullResult:
    """What one pull did: the version the local copy now holds, the full version it was seeded from (None when
    it continued its own chain), the deltas applied, bytes read from the source, seconds, and whether it was a
    no-op (already at the target)."""

    version: int
    seeded_from: int | None
    deltas_applied: list[int]
    bytes_read: int
    seconds: float
    noop: bool


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return None


def read_local_state(local_checkpoint_dir: str) -> dict | None:
    """The parsed state.json of a local checkpoint dir (`version` as an int), or None when it has none."""
    path = os.path.join(local_checkpoint_dir, SYNC_DIR, _STATE)
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
        state["version"] = int(state["version"])
        return state
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as e:
        raise DeltaError(f"{path}: damaged state file ({e}); delete it to reseed from a full version") from None


def read_applied_version(local_checkpoint_dir: str) -> int | None:
    """The version a local checkpoint dir holds, or None (fresh, or a pull failed midway)."""
    state = read_local_state(local_checkpoint_dir)
    return None if state is None else state["version"]


def _write_json(path: str, obj: object) -> None:
    """Write `obj` to `path` atomically (a temp file, fsync, rename)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_state(local_dir: str, version: int, chain_id: str | None) -> None:
    _write_json(
        os.path.join(local_dir, SYNC_DIR, _STATE),
        {"version": f"{version:06d}", "chain_id": chain_id, "boot_id": _boot_id()},
    )


def _invalidate_state(local_dir: str) -> None:
    try:
        os.unlink(os.path.join(local_dir, SYNC_DIR, _STATE))
    except FileNotFoundError:
        pass


def written_files(local_dir: str) -> set[str]:
    """The names of the files in `local_dir` that pulls wrote (empty for a fresh directory)."""
    try:
        with open(os.path.join(local_dir, SYNC_DIR, _FILES), encoding="utf-8") as f:
            names = json.load(f)
    except FileNotFoundError:
        return set()
    except ValueError as e:
        raise DeltaError(
            f"{local_dir}/{SYNC_DIR}/{_FILES}: damaged ({e}); remove the local copy (the whole directory) to reseed it"
        ) from None
    return {n for n in names if isinstance(n, str) and _plain_name(n)}


def _write_files(local_dir: str, names: set[str]) -> None:
    _write_json(os.path.join(local_dir, SYNC_DIR, _FILES), sorted(names))


def _plain_name(name: str) -> bool:
    return name not in ("", ".", "..") and os.sep not in name and not name.startswith(".")


@contextmanager
def local_checkpoint_lock(local_checkpoint_dir: str) -> Iterator[None]:
    """Hold the per-host lock `<local>/.weight_sync/lock` (flock, exclusive). A missing local dir is created
    private to this user (0700)."""
    sync = os.path.join(local_checkpoint_dir, SYNC_DIR)
    os.makedirs(local_checkpoint_dir, mode=0o700, exist_ok=True)
    os.makedirs(sync, mode=0o700, exist_ok=True)
    with open(os.path.join(sync, _LOCK), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _info(source_dir: str, version: int) -> VersionInfo:
    try:
        return read_version_info(version_dir(source_dir, version))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"published weight version {version} is missing: {version_dir(source_dir, version)} does not exist "
            "(versions older than the newest full one are deleted unless --update-weight-disk-keep-files; "
            "pull a version at or after the newest full one)"
        ) from None


def plan_pull(
    source_dir: str, target_version: int, applied: int | None, applied_chain: str | None = None
) -> tuple[int | None, list[int]]:
    """(seed, deltas): the full version to copy first (None: continue from `applied`; 0: the base checkpoint)
    and the delta versions to apply after it, in order, to go from `applied` to `target_version`."""
    if target_version < 0:
        raise ValueError(f"target_version must be >= 0, got {target_version}")
    if target_version == 0:
        return (None, []) if applied == 0 else (0, [])
    target_chain = _info(source_dir, target_version).chain_id
    other_chain = target_chain is not None and applied_chain != target_chain
    if applied is not None and (applied > target_version or other_chain):
        applied = None  # another chain (a resumed run), or ahead of the target: the local bytes cannot be trusted
    if applied == target_version:
        return None, []
    floor = applied if applied is not None else 0
    start = target_version
    while start > floor and _info(source_dir, start).is_delta:
        start -= 1
    if applied is not None and start <= applied:
        return None, list(range(applied + 1, target_version + 1))
    return start, list(range(start + 1, target_version + 1))


def pull_weights(
    local_checkpoint_dir: str,
    source_dir: str,
    target_version: int,
    *,
    base_dir: str | None = None,
    pre_read_hook: Callable[[str, int], None] | None = None,
    verify: bool = True,
    num_threads: int | None = None,
    stage: LiveStage | None = None,
) -> PullResult:
    """Bring `local_checkpoint_dir` to `target_version` of the versions under `source_dir` (see the module doc).

    `base_dir` is version 0 (the engine's own checkpoint): the seed when no full version is published at or
    below the target, and what `target_version=0` resets to. `pre_read_hook(source_dir, target)` runs first for
    a target > 0. With `verify`, a full seed's per-tensor checksums (when it has them) are checked after copying;
    delta checksums are always checked. Raises VersionMismatchError for a delta that does not build on the local
    version, ChecksumMismatchError naming each bad tensor and file, FileNotFoundError for a missing version.

    `stage` (lichen.weights.staging): also apply the deltas to the engine's staging buffers, from the same
    decompressed bytes; used only when the local copy holds the stage's version of its chain and no seed is
    needed (else the stage is marked failed and left alone).
    """
    t0 = time.perf_counter()
    if target_version > 0 and pre_read_hook is not None:
        pre_read_hook(source_dir, target_version)
    local = os.path.abspath(local_checkpoint_dir)
    with local_checkpoint_lock(local):
        state = read_local_state(local)
        if state is not None and state.get("boot_id") and state["boot_id"] != _boot_id():
            state = None  # writes through the page cache before a reboot may be lost
        applied = None if state is None else state["version"]
        seed, deltas = plan_pull(source_dir, target_version, applied, None if state is None else state.get("chain_id"))
        if seed is None and not deltas:
            return PullResult(target_version, None, [], 0, time.perf_counter() - t0, True)
        if stage is not None and (
            seed is not None or applied != stage.version or (state or {}).get("chain_id") != stage.chain_id
        ):
            stage.fail(f"the local copy holds version {applied}, not the staged version {stage.version}")
            stage = None
        bytes_read = 0
        if seed is not None:
            if seed == 0:
                if base_dir is None:
                    raise DeltaError(
                        f"no full version at or below {target_version} under {source_dir!r} and no base "
                        "checkpoint (version 0) given to seed from; a chain starts with a full version"
                    )
                src, chain = base_dir, None
            else:
                src = version_dir(source_dir, seed)
                chain = read_version_info(src).chain_id
            bytes_read += seed_local_checkpoint(
                src, local, seed, chain_id=chain, verify=verify, num_threads=num_threads
            )
        for v in deltas:
            bytes_read += apply_delta_to_checkpoint(
                local, version_dir(source_dir, v), num_threads=num_threads, stage=stage
            )
    return PullResult(target_version, seed, deltas, bytes_read, time.perf_counter() - t0, False)


def _copy_private(src: str, tmp: str) -> None:
    """Copy `src` to the new file `tmp` (never through a link an attacker planted: O_EXCL | O_NOFOLLOW)."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as out, open(src, "rb") as inp:
        shutil.copyfileobj(inp, out, 16 * 1024**2)


def seed_local_checkpoint(
    src_dir: str,
    local_checkpoint_dir: str,
    version: int,
    *,
    chain_id: str | None = None,
    verify: bool = True,
    num_threads: int | None = None,
) -> int:
    """Make the local dir hold a copy of the full checkpoint `src_dir` (the regular files it has; links are
    skipped), check the sizes and, with `verify`, the per-tensor checksums its shards carry; record `version`.
    Returns bytes copied. The caller holds the lock.

    Only files an earlier pull wrote (listed in `.weight_sync/files.json`) are replaced or pruned: a file of the
    same name that a pull did not write is an error, and other files are left alone."""
    if not os.path.isdir(src_dir):
        raise FileNotFoundError(f"full checkpoint {src_dir!r} does not exist")
    os.makedirs(os.path.join(local_checkpoint_dir, SYNC_DIR), mode=0o700, exist_ok=True)
    _invalidate_state(local_checkpoint_dir)
    ours = written_files(local_checkpoint_dir)
    files = sorted(e.name for e in os.scandir(src_dir) if e.is_file(follow_symlinks=False) and _plain_name(e.name))
    foreign = [n for n in files if n not in ours and os.path.lexists(os.path.join(local_checkpoint_dir, n))]
    if foreign:
        raise DeltaError(
            f"{local_checkpoint_dir} holds {foreign[:5]}, which no pull wrote; lichen does not replace "
            "files it did not write: move them away or use an empty --update-weight-local-checkpoint-dir"
        )
    _write_files(local_checkpoint_dir, ours | set(files))  # recorded before writing: a crash leaves no stray file
    copied = 0
    for name in files:
        dst = os.path.join(local_checkpoint_dir, name)
        tmp = os.path.join(local_checkpoint_dir, f".{name}.tmp-{os.getpid()}")
        try:
            os.unlink(tmp)  # a leftover of a crashed pull of this pid; never followed if a link
        except FileNotFoundError:
            pass
        _copy_private(os.path.join(src_dir, name), tmp)
        os.replace(tmp, dst)
        size, want = os.path.getsize(dst), os.path.getsize(os.path.join(src_dir, name))
        if size != want:
            raise DeltaError(f"size mismatch copying {name} from {src_dir}: {want} bytes there, {size} here")
        copied += size
    for name in sorted(ours - set(files)):
        try:
            os.unlink(os.path.join(local_checkpoint_dir, name))
        except FileNotFoundError:
            pass
    _write_files(local_checkpoint_dir, set(files))
    fmt = _index_metadata(local_checkpoint_dir).get("checksum_format") if INDEX_FILE in files else None
    if verify and fmt is not None:  # published full versions carry checksums; a base HF checkpoint may not
        bad = verify_checkpoint(local_checkpoint_dir, fmt, num_threads=num_threads, only=set(files))
        if bad:
            raise ChecksumMismatchError(bad, f"copying {src_dir}")
    _write_state(local_checkpoint_dir, version, chain_id)
    return copied


def _index_metadata(ckpt_dir: str) -> dict:
    path = os.path.join(ckpt_dir, INDEX_FILE)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return dict(json.load(f).get("metadata") or {})
    except (ValueError, AttributeError, TypeError) as e:
        raise DeltaError(f"{path}: damaged index ({e})") from None


def tensor_locations(ckpt_dir: str, only: set[str] | None = None) -> dict[str, tuple[str, int, int]]:
    """name -> (safetensors file, byte offset of its data, byte length), from every shard's header (of the
    files named in `only`, when given)."""
    out: dict[str, tuple[str, int, int]] = {}
    for fname in sorted(os.listdir(ckpt_dir)):
        if not fname.endswith(".safetensors") or fname.startswith(".") or (only is not None and fname not in only):
            continue
        path = os.path.join(ckpt_dir, fname)
        n, header = read_safetensors_header(path)
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            if name in out:
                raise DeltaError(f"tensor {name!r} appears in both {out[name][0]} and {path}")
            begin, end = meta["data_offsets"]
            out[name] = (path, 8 + n + begin, end - begin)
    return out


def verify_checkpoint(
    ckpt_dir: str, checksum_format: str, *, num_threads: int | None = None, only: set[str] | None = None
) -> list[tuple[str, str]]:
    """(tensor, file) for every tensor whose bytes do not match the checksum in its shard's `__metadata__`
    (a tensor without a recorded checksum counts as a mismatch); only the files named in `only`, when given."""
    check_checksum_format(checksum_format)
    items = []
    for path in sorted({p for p, _, _ in tensor_locations(ckpt_dir, only).values()}):
        n, header = read_safetensors_header(path)
        sums = header.get("__metadata__") or {}
        items += [
            (name, path, 8 + n + m["data_offsets"][0], m["data_offsets"][1] - m["data_offsets"][0], sums.get(name))
            for name, m in header.items()
            if name != "__metadata__"
        ]

    def check(item) -> tuple[str, str] | None:
        name, path, offset, nbytes, want = item
        with open(path, "rb") as f:
            if nbytes == 0:
                got = checksum(checksum_format, b"")
            else:
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                    got = checksum(checksum_format, memoryview(mm)[offset : offset + nbytes])
        return None if got == want else (name, path)

    return [r for r in parallel_map(check, items, num_threads) if r is not None]


def _staged(stage: LiveStage, name: str, info: VersionInfo, payload, want: str) -> bool:
    """Decode one payload into the stage (old bytes: the staged ones, else the live ones); True when the result
    matches its checksum, else the stage is marked failed."""
    try:
        src, dst = stage.targets(name)
        got = apply_tensor(info.delta_encoding, payload, dst, source=src, checksum_format=info.checksum_format)
    except KeyError:
        stage.fail(f"the engine holds no tensor {name!r}")
        return False
    except DeltaError as e:
        stage.fail(f"tensor {name!r}: {e}")
        return False
    if got != want:
        stage.fail(f"staged tensor {name!r} does not match its checksum")
        return False
    return True


def apply_delta_to_checkpoint(
    local_checkpoint_dir: str, delta_dir: str, *, num_threads: int | None = None, stage: LiveStage | None = None
) -> int:
    """Apply one delta version in place to the local checkpoint (caller holds the lock); returns bytes read.
    With `stage`, each payload is also applied to the staging buffers (see pull_weights); the stage moves to this
    version when every staged checksum matched, else it is marked failed.

    Refuses (VersionMismatchError, nothing changed) a delta whose base_version or chain is not the local one.
    A tensor whose result does not match its checksum raises ChecksumMismatchError after all tensors are tried;
    the local state is then left unrecorded, so the next pull reseeds from a full version."""
    info = read_version_info(delta_dir)
    check_delta_meta(info)
    state = read_local_state(local_checkpoint_dir)
    applied = None if state is None else state["version"]
    if applied != info.base_version:
        held = "no recorded version" if applied is None else f"version {applied}"
        raise VersionMismatchError(
            f"out-of-order delta: {delta_dir} builds on version {info.base_version}, but "
            f"{local_checkpoint_dir} holds {held}"
        )
    if info.chain_id is not None and state.get("chain_id") not in (None, info.chain_id):
        raise VersionMismatchError(
            f"{delta_dir} belongs to another publishing chain than "
            f"{local_checkpoint_dir} (a restarted run); pull its newest full version first"
        )
    items, read = delta_payloads(info)
    if items:
        locations = tensor_locations(local_checkpoint_dir, written_files(local_checkpoint_dir))
        missing = [name for name, *_ in items if name not in locations]
        if missing:
            raise DeltaError(f"{delta_dir} changes tensor(s) {missing[:5]} that {local_checkpoint_dir} does not hold")
        _invalidate_state(local_checkpoint_dir)
        fds: dict[str, int] = {}
        try:
            for path in sorted({locations[name][0] for name, *_ in items}):
                fds[path] = os.open(path, os.O_RDWR | os.O_NOFOLLOW)  # only the file a pull wrote, never a link

            def apply_one(item) -> tuple[str, str, str | None] | None:
                name, dfile, payload, want = item
                path, offset, nbytes = locations[name]
                if stage is not None and stage.usable and _staged(stage, name, info, payload, want):
                    try:  # the staged bytes are verified: the local copy takes them as they are
                        write_at(fds[path], stage.targets(name)[1], offset)
                        return None
                    except OSError as e:
                        return name, f"{dfile} (writing to {path})", str(e)
                try:
                    got = apply_tensor_at(
                        info.delta_encoding, payload, fds[path], offset, nbytes, checksum_format=info.checksum_format
                    )
                except DeltaError as e:
                    return name, f"{dfile} (applying to {path})", str(e)
                return None if got == want else (name, f"{dfile} -> {path}", None)

            failed = [r for r in parallel_map(apply_one, items, num_threads) if r is not None]
        finally:
            for fd in fds.values():
                os.close(fd)
        broken = [f"tensor {name!r} in {where}: {err}" for name, where, err in failed if err is not None]
        if broken:
            raise DeltaError(f"cannot apply {delta_dir}: " + "; ".join(broken[:10]))
        if failed:
            if stage is not None:
                stage.fail(f"checksum mismatch in {delta_dir}")
            raise ChecksumMismatchError([(name, where) for name, where, _ in failed], delta_dir)
    if stage is not None and stage.usable:
        stage.version = info.version
    _write_state(local_checkpoint_dir, info.version, info.chain_id or (state or {}).get("chain_id"))
    return read
