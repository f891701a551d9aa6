"""Optional native speed-ups (the system's libzstd through ctypes, numba kernels): loaded once, on first use, and
kept only when a self-test passes. Otherwise `get()` is None, `status()` says why, and callers take their numpy /
python-zstandard path, which gives the same bytes. A leaf: the standard library only.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any


class Unavailable(Exception):
    """Raised by a loader for an expected reason not to use the speed-up (its message becomes the status)."""


class Native:
    """`load()` returns the object (raising Unavailable or anything else when it cannot); `self_test(obj)` returns
    None or what went wrong. The object is `value` already during its self-test (code under test reads it there)
    and stays None after a failure. The environment variable `env_var` set to "0" turns it off. Thread-safe."""

    def __init__(self, load: Callable[[], Any], self_test: Callable[[Any], str | None], env_var: str):
        self._load, self._self_test, self.env_var = load, self_test, env_var
        self.value: Any = None
        self.state = "unloaded"  # "unloaded" | "ok" | "unavailable: <why>"
        self._lock = threading.Lock()

    def get(self) -> Any:
        """The object, or None when unavailable (loads and self-tests it on the first call)."""
        with self._lock:
            if self.state == "unloaded":
                self.state = self._try()
            return self.value

    def _try(self) -> str:
        if os.environ.get(self.env_var, "1") == "0":
            return f"unavailable: {self.env_var}=0"
        try:
            self.value = self._load()
            problem = self._self_test(self.value)
        except Unavailable as e:
            problem = str(e)
        except Exception as e:  # any failure means: do not trust it
            problem = f"{type(e).__name__}: {e}"
        if problem:
            self.value = None
            return f"unavailable: {problem}"
        return "ok"

    def available(self) -> bool:
        return self.get() is not None

    def status(self) -> str:
        """ "ok" or "unavailable: <why>"."""
        self.get()
        return self.state
