"""Custom reward functions used by tests/test_rewards.py as `--custom-rm-path rm_plugins.<name>`."""

import asyncio
import time


def sync_rm(args, sample):
    """1.0 iff the response equals the label; args.bonus (if set) is added, to show args arrive."""
    return float(sample.response == sample.label) + getattr(args, "bonus", 0.0)


async def async_rm(args, sample):
    await asyncio.sleep(0.01)
    return {"score": float(sample.response == sample.label), "pred": sample.response}


HANG_S = 10.0
HANGS_FINISHED: list[int] = []


def flaky_rm(args, sample):
    """Behaves as sample.metadata["mode"] says: ok / raise / hang / nan / dict_nan / none / own_timeout."""
    mode = sample.metadata.get("mode", "ok")
    if mode == "raise":
        raise ValueError("cannot parse the answer")
    if mode == "hang":
        time.sleep(HANG_S)
        HANGS_FINISHED.append(sample.index)  # lets a test see that it returned while this call was still hung
        return 1.0
    if mode == "nan":
        return float("nan")
    if mode == "dict_nan":
        return {"score": float("inf"), "pred": "x"}
    if mode == "none":
        return None
    if mode == "own_timeout":
        raise TimeoutError("sandbox did not answer")
    return 1.0


async def async_hang_rm(args, sample):
    if sample.metadata.get("mode") == "hang":
        await asyncio.sleep(30)
    return 0.5


class OddError(BaseException):
    """Not an Exception: a verifier raising it must still fail only its sample."""


def base_exception_rm(args, sample):
    """Raises what sample.metadata["mode"] names (exit / odd / generator_exit / cancel / interrupt), else 1.0."""
    return _raise_mode(sample)


async def async_base_exception_rm(args, sample):
    await asyncio.sleep(0)
    return _raise_mode(sample)


def _raise_mode(sample):
    mode = sample.metadata.get("mode", "ok")
    if mode == "exit":
        raise SystemExit(3)
    if mode == "odd":
        raise OddError("not an Exception")
    if mode == "generator_exit":
        raise GeneratorExit()
    if mode == "cancel":
        raise asyncio.CancelledError()
    if mode == "interrupt":
        raise KeyboardInterrupt()
    if mode == "huge":
        return 1e308
    if mode == "dict_huge":
        return {"score": -1e16, "acc": True}
    if mode == "big_but_fine":
        return 1e15
    return 1.0
