"""Reading files of a directory that may hold planted links and special files (checkpoints, run directories).

`open_inside(root, rel)` opens `root`/`rel` only if, every symlink resolved, it lies inside `root` and is a regular
file: opened without following a last symlink swapped in after the check (O_NOFOLLOW), without blocking on a FIFO
(O_NONBLOCK), and checked with fstat. So a link to a file elsewhere cannot make a message reveal that file's size
or contents, and a FIFO, /dev/zero or /proc/self/pagemap cannot hang a reader or fill its memory; `read_inside`
also caps the bytes read. A shared helper every package may import (docs/architecture.md#import-directions).
"""

from __future__ import annotations

import os
import stat
from typing import BinaryIO


class UnsafeFile(Exception):
    """A file refused by `open_inside` (or missing); the message says why, never anything about a link's target."""


def open_inside(root: str, rel: str) -> BinaryIO:
    """`root`/`rel` opened for binary reading if it is a regular file inside `root`; UnsafeFile otherwise."""
    real_root = os.path.realpath(root)
    path = os.path.realpath(os.path.join(root, rel))
    if os.path.commonpath([real_root, path]) != real_root:
        raise UnsafeFile("a link that leads outside its directory; refused")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise UnsafeFile("missing") from None
    except OSError as e:
        raise UnsafeFile(f"cannot be opened ({e.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafeFile("not a regular file (a directory, device, FIFO or socket); refused")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_inside(root: str, rel: str, max_bytes: int) -> bytes:
    """The contents of the regular file `root`/`rel` (open_inside); UnsafeFile if it holds over `max_bytes`."""
    with open_inside(root, rel) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise UnsafeFile(f"larger than the {max_bytes} bytes such a file can hold; refused")
    return data
