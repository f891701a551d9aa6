"""Device names -> torch devices, one rule for the trainer, the in-process engine and `lichen serve`.

A shared helper every package may import (docs/architecture.md#import-directions); torch is imported on use, so
importing this module costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lichen.errors import ConfigError

if TYPE_CHECKING:
    import torch


def resolve_device(name: str) -> "torch.device":
    """`auto` is cuda when torch sees a CUDA device, else cpu; any other name is torch's (cpu, cuda, cuda:1, ...).
    A name torch does not know, or cuda where there is none, is a ConfigError naming --device."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"--device {name!r} is not a device torch knows ({e}); use cpu, cuda or auto") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: CUDA is not available here; use --device cpu")
    return dev
