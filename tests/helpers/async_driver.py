"""Running the asynchronous drivers (lichen/loop_async.py) on fakes, shared by tests/test_async*.py."""

from __future__ import annotations

import threading

from lichen.config.engine_config import ObserveConfig
from lichen.observe.run_observer import RunObserver

WAIT = 120  # seconds: a generous bound for something that must happen, never a timing window


class StepLogger:
    """The metrics logger a driver writes to: step -> metrics."""

    def __init__(self):
        self.steps: dict[int, dict] = {}

    def log(self, step, metrics):
        self.steps[step] = dict(metrics)


def run_driver(driver, args, trainer, rollout) -> StepLogger:
    logger = StepLogger()
    observer = RunObserver(ObserveConfig.from_args(args))
    try:
        driver(args, trainer, rollout, logger, observer)
    finally:
        observer.close()
    return logger


def assert_threads_end(prefix: str) -> None:
    """Every thread named `prefix...` ends (within WAIT seconds)."""
    for t in threading.enumerate():
        if t.name.startswith(prefix):
            t.join(WAIT)
            assert not t.is_alive(), f"{t.name} still running"


def assert_side_error(run, side: str, cause: str, thread_prefix: str) -> None:
    """`run()` fails with the driver's SideError naming `side` and `cause`, and the rollout thread ends."""
    import pytest

    from lichen.loop_async import SideError

    with pytest.raises(SideError, match=f"the {side} side failed at rollout step") as info:
        run()
    assert cause in str(info.value)
    assert_threads_end(thread_prefix)
