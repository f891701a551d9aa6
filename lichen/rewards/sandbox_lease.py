"""Sandbox uid slots: which uid a sandboxed run gets, leased host-wide through lock files.

The lock files live in `<tmp>/lichen-sandbox-locks-<euid>` (tmp: $TMPDIR or /tmp). That path is predictable and
/tmp is shared, so the directory is trusted only when it is a real directory (not a symlink) owned by this
process's euid with no access for group or others: a local user who made it first could otherwise hold every
slot's lock (every code reward waits forever) or plant a symlink that makes a root trainer create a file where
they choose. Anything else is refused with the path and what to do; lock files are opened relative to the
directory's descriptor with O_NOFOLLOW and must be regular files.
"""

from __future__ import annotations

import errno
import fcntl
import os
import random
import stat
import tempfile

from lichen.errors import ConfigError

NOBODY = 65534
SLOTS = 256


class LockDirUnsafe(ConfigError):
    """The lock directory or a lock file in it is not private to this user."""


def lock_dir_path() -> str:
    return os.path.join(tempfile.gettempdir(), f"lichen-sandbox-locks-{os.geteuid()}")


def open_lock_dir() -> int:
    """A descriptor of the private lock directory, made 0700 when missing; LockDirUnsafe when it is a symlink,
    not a directory, not ours or open to others. The checks are made on the opened descriptor, so the path
    cannot be swapped between the check and the use."""
    path = lock_dir_path()
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    fix = f"remove it (rm -rf {path}; another local user may have made it) or point TMPDIR at a private directory"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:  # O_NOFOLLOW | O_DIRECTORY on a symlink: ELOOP or ENOTDIR, by kernel
        what = "a symlink" if os.path.islink(path) else "not a directory" if e.errno == errno.ENOTDIR else str(e)
        raise LockDirUnsafe(f"code sandbox lock directory {path} is {what}; {fix}") from None
    st = os.fstat(fd)
    problem = None
    if st.st_uid != os.geteuid():
        problem = f"is owned by uid {st.st_uid}, not {os.geteuid()} (this process)"
    elif st.st_mode & 0o077:
        problem = f"has mode {stat.S_IMODE(st.st_mode):04o}; it must be 0700 (no access for group or others)"
    if problem is not None:
        os.close(fd)
        raise LockDirUnsafe(f"code sandbox lock directory {path} {problem}; {fix}")
    return fd


def open_lock_file(dir_fd: int, name: str) -> int:
    """The lock file `name` in the lock directory, created 0600 when missing, never through a symlink."""
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
    except OSError as e:
        what = "a symlink" if e.errno == errno.ELOOP else str(e)
        raise LockDirUnsafe(f"code sandbox lock file {lock_dir_path()}/{name} is {what}; remove it") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise LockDirUnsafe(
            f"code sandbox lock file {lock_dir_path()}/{name} is not a regular file of uid {os.geteuid()}; remove it"
        )
    return fd


class UidLease:
    """Exclusive use of one sandbox uid while a run lasts, across threads and processes on this host.

    Slot i is held through an exclusive flock on `lichen-sandbox-<uid>.lock` in the private lock directory; the
    kernel drops it when the file is closed, also when the holder dies, so a crashed trainer holds no slot.
    """

    def __init__(self, uid_base: int) -> None:
        self.uid_base = uid_base
        self.uid: int | None = None
        self._fd: int | None = None

    def try_take(self) -> bool:
        """Take a free slot (True), or False when all SLOTS are held. LockDirUnsafe when the locks are not ours."""
        if self.uid_base == NOBODY:  # the fallback: one shared uid
            self.uid = NOBODY
            return True
        dir_fd = open_lock_dir()
        try:
            start = random.randrange(SLOTS)
            for k in range(SLOTS):
                uid = self.uid_base + (start + k) % SLOTS
                fd = open_lock_file(dir_fd, f"lichen-sandbox-{uid}.lock")
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    os.close(fd)
                    continue
                self.uid, self._fd = uid, fd
                return True
            return False
        finally:
            os.close(dir_fd)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
