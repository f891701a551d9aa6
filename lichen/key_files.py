"""Secrets from key files or environment variables, never from the command line.

Every local user can read another process's argv in `ps`, so engine keys (lichen.engines.api.auth) and the remote
reward model's key (lichen.rewards.remote_rm) come from a file that only its owner can read, or from the
environment. A shared helper every package may import (docs/architecture.md#import-directions).
"""

from __future__ import annotations

import os
import stat

from lichen.errors import ConfigError


def read_key_file(path: str, flag: str) -> str:
    """The key in `path` (surrounding whitespace stripped); ConfigError naming `flag` when it is missing, empty or
    readable by group or others."""
    try:
        fd = os.open(path, os.O_RDONLY)  # links allowed (mounted secrets are links); the mode checked is the file's
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot read the key file ({e.strerror or e})") from None
    with os.fdopen(fd, encoding="utf-8", errors="strict") as f:
        mode = os.fstat(f.fileno()).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(
                f"{flag} {path}: the key file is readable by other users (mode {stat.filemode(mode)}); "
                f"run `chmod 600 {path}`"
            )
        try:
            key = f.read().strip()
        except UnicodeDecodeError:
            raise ConfigError(f"{flag} {path}: the key file is not UTF-8 text") from None
    if not key or any(c.isspace() for c in key):
        raise ConfigError(
            f"{flag} {path}: the key file must hold one key (no spaces), got "
            f"{'nothing' if not key else 'several words'}"
        )
    return key


def resolve_key(
    *, flag_value: str | None, file_path: str | None, env: str, flag: str, file_flag: str, pop_env: bool = False
) -> str | None:
    """A key from the flag, else the key file, else the environment variable `env` (removed with `pop_env`, so
    processes this one starts do not inherit it). Giving both the flag and the file is an error."""
    if flag_value is not None and file_path is not None:
        raise ConfigError(
            f"{flag} and {file_flag} both give the key; keep {file_flag} (a key on the command line "
            "is visible to every local user in `ps`)"
        )
    from_env = os.environ.pop(env, None) if pop_env else os.environ.get(env)
    if flag_value is not None:
        return flag_value
    if file_path is not None:
        return read_key_file(file_path, file_flag)
    return from_env or None
