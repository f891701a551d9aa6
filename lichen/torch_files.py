"""torch.save / torch.load files that hold plain data only, so reading one never runs code.

Every `.pt` file lichen writes (trainer_state.pt, critic.pt, --save-debug-rollout-data dumps) holds tensors and
plain Python values: dict, list, tuple, set, str, bytes, int, float, complex, bool, None. That is what
`torch.load(weights_only=True)` accepts, and every read goes through `load_plain`, which uses nothing else: a
crafted file (a pickle whose `__reduce__` calls `os.system`, say) is refused before any of its code runs.

`to_plain` converts what a run may put into a Sample (numpy scalars and arrays from a custom reward, enums,
datetimes or decimals from parquet rows) into such values before a dump is written, so every dump loads back.
"""

from __future__ import annotations

import enum
import os
import pickle
import re
from typing import Any

import torch

from lichen.errors import UserError

_PLAIN_SCALARS = (str, bytes, int, float, complex, bool, type(None))


class UnreadableFile(UserError):
    """A .pt file that is damaged, or holds something other than tensors and plain data."""


def load_plain(path: str, what: str) -> Any:
    """torch.load(path, weights_only=True) onto the CPU; any failure is an `UnreadableFile` naming `what` and path.

    Tensors land on the CPU: callers move them (Optimizer.load_state_dict and Module.load_state_dict already copy
    onto their parameters' device; RNG states must be CPU tensors).
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UnreadableFile(f"{what} {path}: no such file") from None
    except pickle.UnpicklingError as e:
        detail = _unpickler_detail(str(e))
        culprit = re.search(r"Unsupported global: GLOBAL (\S+)", detail)
        if culprit:
            raise UnreadableFile(
                f"{what} {path}: refused: it names {culprit.group(1)}, which loading would call; lichen's .pt files "
                "hold tensors and plain data only (damaged, written by something else, or crafted to run code)"
            ) from None
        raise UnreadableFile(f"{what} {path}: damaged or not a torch file ({detail})") from None
    except EOFError:
        raise UnreadableFile(f"{what} {path}: damaged: it ends early (empty or truncated)") from None
    except (RuntimeError, ValueError, OSError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UnreadableFile(f"{what} {path}: damaged or not a torch file ({type(e).__name__}: {first})") from None


def _unpickler_detail(message: str) -> str:
    """The cause torch's weights-only unpickler reports, without the advice around it (to load it unsafely)."""
    if "WeightsUnpickler error:" in message:
        cause = message.split("WeightsUnpickler error:", 1)[1].strip().splitlines()
        if cause:
            return cause[0].split(" was not an allowed")[0].strip()
    return "unreadable pickle"


def save_plain(obj: Any, path: str) -> None:
    """torch.save(obj) to `path` atomically (a sibling `<path>.tmp-<pid>`, fsynced, then renamed into place)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def to_plain(obj: Any, converted: list[str] | None = None, where: str = "") -> Any:
    """`obj` with every value `load_plain` would refuse converted: numpy values to Python ones (`tolist`), enums to
    their value, anything else to `str(value)`; the paths of the values made strings are appended to `converted`.
    """
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, enum.Enum):
        return to_plain(obj.value, converted, where)
    if isinstance(obj, _PLAIN_SCALARS):
        return obj
    if isinstance(obj, dict):
        return {to_plain(k, converted, where): to_plain(v, converted, f"{where}.{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        items = [to_plain(v, converted, f"{where}[{i}]") for i, v in enumerate(obj)]
        if isinstance(obj, set):
            return set(items)
        return tuple(items) if isinstance(obj, tuple) else items
    tolist = getattr(obj, "tolist", None)  # numpy scalars and arrays (not imported here: numpy is optional)
    if callable(tolist) and type(obj).__module__.startswith("numpy"):
        return to_plain(tolist(), converted, where)
    if converted is not None:
        converted.append(f"{where or 'value'} ({type(obj).__name__})")
    return str(obj)
