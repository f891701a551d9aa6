"""Bounded text of hostile values, for error messages and logs.

A request body, a pickle or a data row can hold a value whose plain `repr` is enormous: a 260-byte pickle that
shares one list 17 times per level reprs to 124 MB (issue 33), and `json.dumps` of a 16 MB field is 16 MB. Every
place that formats untrusted input into an error goes through `excerpt` (Python repr) or `json_excerpt` (JSON
spelling: null, true, "text"), which look at a bounded number of items and levels (reprlib) and cut the result to
`limit` characters, so building the message costs bounded time and memory whatever the value is.
"""

from __future__ import annotations

import json
import reprlib
from typing import Any

DEFAULT_LIMIT = 120


class _Bounded(reprlib.Repr):
    """reprlib with small caps everywhere, and no unbounded `repr` of big ints or bytes."""

    def __init__(self, limit: int, as_json: bool):
        super().__init__()
        self.as_json = as_json
        self.maxlevel = 3
        self.maxtuple = self.maxlist = self.maxarray = self.maxdict = 4
        self.maxset = self.maxfrozenset = self.maxdeque = 4
        self.maxstring = self.maxlong = self.maxother = max(8, limit)

    def repr1(self, x: Any, level: int) -> str:
        if self.as_json:
            if x is None:
                return "null"
            if isinstance(x, bool):
                return "true" if x else "false"
            if isinstance(x, str):
                cut = x[: self.maxstring]
                return json.dumps(cut) + ("..." if len(x) > len(cut) else "")
        return super().repr1(x, level)

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 256:  # repr of a huge int costs quadratic time (and fails past 4,300 digits)
            return f"<int of {x.bit_length()} bits>"
        return super().repr_int(x, level)

    def repr_bytes(self, x: bytes, level: int) -> str:
        cut = x[: self.maxstring]
        return repr(cut) + ("..." if len(x) > len(cut) else "")

    repr_bytearray = repr_bytes

    def repr_instance(self, x: Any, level: int) -> str:
        try:
            return super().repr_instance(x, level)
        except Exception:  # a hostile object's __repr__ may raise; its type is enough then
            return f"<{type(x).__name__}>"


def excerpt(value: Any, limit: int = DEFAULT_LIMIT) -> str:
    """repr(value), bounded: at most `limit` characters (plus "..."), built in bounded time."""
    return clip(_Bounded(limit, as_json=False).repr(value), limit)


def json_excerpt(value: Any, limit: int = DEFAULT_LIMIT) -> str:
    """A JSON value as JSON (null, true, "text", [1, 2, ...]), bounded like `excerpt`."""
    return clip(_Bounded(limit, as_json=True).repr(value), limit)


def clip(text: str, limit: int = DEFAULT_LIMIT) -> str:
    """`text` cut to `limit` characters (an exception's message, a path), marked with "..." when cut."""
    return text if len(text) <= limit else text[:limit] + "..."
