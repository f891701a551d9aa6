"""Loading user plug-ins by dotted path (`package.module.attr`), as `--custom-rm-path` and friends take them."""

from __future__ import annotations

import importlib
from typing import Any, Callable

from lichen.errors import ConfigError


def load_function(path: str, flag: str) -> Callable[..., Any]:
    """Import `module.attr` and return the attribute; any failure is a ConfigError naming `flag`."""
    module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{flag} {path!r}: expected a dotted path 'package.module.function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or the module itself raising at import
        raise ConfigError(f"{flag} {path!r}: cannot import module {module_name!r}: {e}") from e
    try:
        fn = getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{flag} {path!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not callable(fn):
        raise ConfigError(f"{flag} {path!r}: {attr!r} is not callable")
    return fn
