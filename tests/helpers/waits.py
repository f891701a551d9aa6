"""Bounded waits the tests share: a condition polled until true (the bound is only a failure bound), a process gone."""

from __future__ import annotations

import os
import time
from typing import Callable

import pytest


def wait_for(cond: Callable[[], object], timeout: float = 120.0, what: str = "condition") -> None:
    """Poll `cond` every 50 ms until it is true; pytest.fail naming `what` after `timeout` seconds."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def gone(pid: int) -> bool:
    """Whether no process `pid` exists (any more)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False
