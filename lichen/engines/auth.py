"""API keys of engine servers: which paths need which key, how a request's key is checked, and where keys come from.

Keys never travel on a command line (every local user can read another process's argv in `ps`): `lichen serve`
reads them from a key file (`--api-key-file`, `--admin-api-key-file`) or the environment (`LICHEN_API_KEY`,
`LICHEN_ADMIN_API_KEY`, removed from the environment once read); `lichen train` gives the engines it launches a
fresh random key per run that way, and reads an external engine's key from `--rollout-external-engine-api-key-file`
or `LICHEN_ENGINE_API_KEY` (`LICHEN_ENGINE_ADMIN_API_KEY` / `--rollout-external-engine-admin-api-key-file` for its
admin key). A key file must not be readable by group or others (chmod 600).

SGLang's rule for requests (docs/architecture.md#engine-authentication): a key is accepted from `Authorization:
Bearer KEY` or from
`x-api-key: KEY`; a request passes when either header carries the right key.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from typing import Mapping

from lichen.errors import ConfigError

# SGLang's ADMIN_OPTIONAL endpoints plus lichen's weight endpoints: an admin key, when set, is required here (and
# the plain key is not accepted); otherwise the plain key is. Paths under OPEN_PREFIXES need no key at all.
ADMIN_PATHS = frozenset({
    "/abort_request", "/pause_generation", "/continue_generation", "/flush_cache", "/update_weights_from_disk",
    "/update_weight_version", "/release_memory_occupation", "/resume_memory_occupation", "/get_weights_by_name",
    "/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group",
    "/pull_weights", "/weights_checker",
})
OPEN_PREFIXES = ("/health", "/ready", "/metrics")

SERVE_KEY_ENV = "LICHEN_API_KEY"
SERVE_ADMIN_KEY_ENV = "LICHEN_ADMIN_API_KEY"
ENGINE_KEY_ENV = "LICHEN_ENGINE_API_KEY"
ENGINE_ADMIN_KEY_ENV = "LICHEN_ENGINE_ADMIN_API_KEY"


def new_key() -> str:
    """A fresh random key (256 bits)."""
    return secrets.token_urlsafe(32)


def key_for_path(path: str, api_key: str | None, admin_api_key: str | None) -> str | None:
    """The key a request to `path` must carry (None: none needed)."""
    if path.startswith(OPEN_PREFIXES):
        return None
    if admin_api_key and path in ADMIN_PATHS:
        return admin_api_key
    return api_key


def request_has_key(headers: Mapping[str, str], key: str) -> bool:
    """Whether `Authorization: Bearer KEY` or `x-api-key: KEY` carries `key` (either one suffices)."""
    want = key.encode()
    given = []
    auth = headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        given.append(auth[7:].strip())
    if headers.get("x-api-key") is not None:
        given.append(headers["x-api-key"])
    # compare every candidate, so the time taken does not depend on which header matched
    return any([hmac.compare_digest(g.encode(), want) for g in given])


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
            raise ConfigError(f"{flag} {path}: the key file is readable by other users (mode {stat.filemode(mode)}); "
                              f"run `chmod 600 {path}`")
        try:
            key = f.read().strip()
        except UnicodeDecodeError:
            raise ConfigError(f"{flag} {path}: the key file is not UTF-8 text") from None
    if not key or any(c.isspace() for c in key):
        raise ConfigError(f"{flag} {path}: the key file must hold one key (no spaces), got "
                          f"{'nothing' if not key else 'several words'}")
    return key


def resolve_key(*, flag_value: str | None, file_path: str | None, env: str, flag: str, file_flag: str,
                pop_env: bool = False) -> str | None:
    """A key from the flag, else the key file, else the environment variable `env` (removed with `pop_env`, so
    processes this one starts do not inherit it). Giving both the flag and the file is an error."""
    if flag_value is not None and file_path is not None:
        raise ConfigError(f"{flag} and {file_flag} both give the key; keep {file_flag} (a key on the command line "
                          "is visible to every local user in `ps`)")
    from_env = os.environ.pop(env, None) if pop_env else os.environ.get(env)
    if flag_value is not None:
        return flag_value
    if file_path is not None:
        return read_key_file(file_path, file_flag)
    return from_env or None
