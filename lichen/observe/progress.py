"""Progress bars (tqdm on stderr) and a line printer that does not tear them."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, TextIO

from tqdm import tqdm


def progress(
    iterable: Iterable[Any] | None = None, *, total: int | None = None, desc: str = "", disable: bool = False
) -> tqdm:
    """A tqdm bar on stderr that follows the terminal width. Use as an iterator wrapper, or without `iterable`
    call `.update(n)` and `.close()` (or use it as a context manager). `disable=True` makes it silent."""
    return tqdm(iterable, total=total, desc=desc, disable=disable, file=sys.stderr, dynamic_ncols=True)


def print_line(text: str, file: TextIO | None = None) -> None:
    """Print `text` (to stdout unless `file` is given) through tqdm.write: open bars are cleared first and
    redrawn after, so the line is not interleaved with a bar."""
    tqdm.write(text, file=file if file is not None else sys.stdout)
