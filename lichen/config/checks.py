"""Small helpers the flag-group modules use to check values; each failure is a `ConfigError` naming the flag."""

from __future__ import annotations

import argparse
import math
import os
import re
from typing import Any

from lichen.config.parser import flag_of
from lichen.errors import ConfigError

_SLICE_SUFFIX = re.compile(r"^(?P<path>.+)@\[[^\]]*\]$")


def given(args: argparse.Namespace, dest: str) -> bool:
    """True when the flag was set explicitly on the command line or in the --config file."""
    return dest in getattr(args, "_explicit", set())


def fail(message: str) -> None:
    raise ConfigError(message)


def check_int_at_least(args: argparse.Namespace, dest: str, low: int, what: str = "") -> None:
    """`args.<dest>` (if not None) must be >= low."""
    value = getattr(args, dest)
    if value is not None and value < low:
        fail(f"{flag_of(dest)} {value}: must be >= {low}{what}")


def check_float(
    args: argparse.Namespace,
    dest: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """`args.<dest>` (if not None) must be finite and lie in the interval given; the message states the interval.
    inf is never a value: argparse's float() takes "inf", and e.g. --lr inf only fails steps later, far away."""
    value = getattr(args, dest)
    if value is None:
        return
    ok = math.isfinite(value)  # NaN and +-inf are never allowed
    if low is not None:
        ok = ok and (value > low if low_open else value >= low)
    if high is not None:
        ok = ok and (value < high if high_open else value <= high)
    if not ok:
        left = "(" if low_open else "["
        right = ")" if high_open or high is None else "]"
        lo = "-inf" if low is None else f"{low:g}"
        hi = "inf" if high is None else f"{high:g}"
        fail(f"{flag_of(dest)} {value}: must be a finite number in {left}{lo}, {hi}{right}")


def data_file_of(spec: str) -> str:
    """The file part of a data spec `PATH` or `PATH@[a:b]`."""
    m = _SLICE_SUFFIX.match(spec)
    return m.group("path") if m else spec


def check_data_file(spec: str, flag: str) -> None:
    """The file named by a data spec must exist (the row slice itself is checked when the data loads)."""
    path = data_file_of(spec)
    if not os.path.isfile(path):
        what = "is a directory, not a file" if os.path.isdir(path) else "does not exist"
        fail(f"{flag} {spec!r}: {path!r} {what}; give a .jsonl or .parquet file (optionally PATH@[start:stop])")


def _dcp_shards(path: str) -> bool:
    names = os.listdir(path)
    return ".metadata" in names or any(n.endswith(".distcp") for n in names)


def is_torch_dist(path: str) -> bool:
    """A Megatron `torch_dist` checkpoint: torch.distributed.checkpoint shards (`.metadata`, `*.distcp`) in `path`
    or in its `iter_*` directories. lichen's own checkpoints share the `iter_*` / latest-file layout but hold
    meta.json and an `hf/` directory instead of shards."""
    if not os.path.isdir(path):
        return False
    if _dcp_shards(path):
        return True
    for name in os.listdir(path):
        sub = os.path.join(path, name)
        if name.startswith("iter_") and os.path.isdir(sub) and _dcp_shards(sub):
            return not os.path.isfile(os.path.join(sub, "meta.json"))
    return False


def check_not_torch_dist(path: str, flag: str) -> None:
    """slime scripts point --load / --ref-load at Megatron checkpoints; lichen reads Hugging Face ones."""
    if is_torch_dist(path):
        fail(
            f"{flag} {path!r}: a Megatron torch_dist checkpoint (distributed shards, no config.json); lichen "
            "loads Hugging Face checkpoints: give the HF directory it was converted from (for a reference model, "
            "the --hf-checkpoint directory, or drop --ref-load; `lichen port-slime --ref-load-is-hf-checkpoint` "
            "does that for a converted slime script), or convert it with slime's tools/convert_torch_dist_to_hf.py"
        )


def check_hf_dir(path: str, flag: str) -> None:
    """An HF checkpoint is a directory holding config.json."""
    if not os.path.isdir(path):
        fail(f"{flag} {path!r}: no such directory; give a Hugging Face checkpoint directory (with config.json)")
    check_not_torch_dist(path, flag)
    if not os.path.isfile(os.path.join(path, "config.json")):
        fail(f"{flag} {path!r}: no config.json in this directory; give a Hugging Face checkpoint directory")


def check_dotted_path(args: argparse.Namespace, dest: str) -> None:
    """A plug-in path must import and name a callable; loaded now so a typo fails before any model loads."""
    value: Any = getattr(args, dest)
    if value is None:
        return
    from lichen.plugins import load_function

    load_function(value, flag_of(dest))
