"""Custom reward functions used by tests/test_rewards.py as `--custom-rm-path rm_plugins.<name>`."""

import asyncio
import time


def sync_rm(args, sample):
    """1.0 iff the response equals the label; args.bonus (if set) is added, to show args arrive."""
    return float(sample.response == sample.label) + getattr(args, "bonus", 0.0)


async def async_rm(args, sample):
    await asyncio.sleep(0.01)
    return {"score": float(sample.response == sample.label), "pred": sample.response}


def flaky_rm(args, sample):
    """Behaves as sample.metadata["mode"] says: ok / raise / hang / nan / dict_nan / none / own_timeout."""
    mode = sample.metadata.get("mode", "ok")
    if mode == "raise":
        raise ValueError("cannot parse the answer")
    if mode == "hang":
        time.sleep(3.0)
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
