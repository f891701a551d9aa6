"""API keys of engine servers: which paths need which key, how a request's key is checked, and where keys come from.

Keys never travel on a command line (every local user can read another process's argv in `ps`): `lichen serve`
reads them from a key file (`--api-key-file`, `--admin-api-key-file`) or the environment (`LICHEN_API_KEY`,
`LICHEN_ADMIN_API_KEY`, removed from the environment once read); `lichen train` gives the engines it launches a
fresh random key per run that way, and reads an external engine's key from `--rollout-external-engine-api-key-file`
or `LICHEN_ENGINE_API_KEY` (`LICHEN_ENGINE_ADMIN_API_KEY` / `--rollout-external-engine-admin-api-key-file` for its
admin key). A key file must not be readable by group or others (chmod 600); reading
key files and key variables is lichen.key_files'.

SGLang's rule for requests (docs/architecture.md#engine-authentication): a key is accepted from `Authorization:
Bearer KEY` or from
`x-api-key: KEY`; a request passes when either header carries the right key.
"""

from __future__ import annotations

import hmac
import secrets
from typing import Mapping

# SGLang's ADMIN_OPTIONAL endpoints plus lichen's weight endpoints: an admin key, when set, is required here (and
# the plain key is not accepted); otherwise the plain key is. Paths under OPEN_PREFIXES need no key at all.
ADMIN_PATHS = frozenset(
    {
        "/abort_request",
        "/pause_generation",
        "/continue_generation",
        "/flush_cache",
        "/update_weights_from_disk",
        "/update_weight_version",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/get_weights_by_name",
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/destroy_weights_update_group",
        "/pull_weights",
        "/weights_checker",
        "/debug/stacks",
        "/update_weights_from_tensor",
        "/reset_peak_memory",  # lichen's own: resets what the trainer measures (info_endpoints)
    }
)
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
