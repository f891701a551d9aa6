"""Flags lichen has removed, each with why and what to do instead.

They are checked before argparse runs, so a removed flag gets its own message rather than "unrecognized
argument". To retire a flag: delete it from its group module and add a line here.
"""

from __future__ import annotations

from lichen.errors import ConfigError

REMOVED_FLAGS: dict[str, str] = {
    "--train-memory-margin-bytes": "was removed: the memory saver's own default margin is used now; drop this flag",
    "--rollout-external-engine-api-key": "was removed: a key on the command line is visible to every local user in "
    "`ps`; put it in a file (chmod 600) given with --rollout-external-engine-api-key-file, or in "
    "$LICHEN_ENGINE_API_KEY",
    "--megatron-to-hf-mode": "was removed: slime itself removed it after its PR #2249, and lichen loads and saves "
    "Hugging Face checkpoints directly; drop this flag",
}


def removed_message(flag: str) -> str | None:
    """The error text for a removed flag, or None if `flag` was not removed."""
    why = REMOVED_FLAGS.get(flag)
    return None if why is None else f"{flag} {why}"


def check_removed(argv: list[str]) -> None:
    """Raise ConfigError for the first removed flag in `argv` (`--flag` or `--flag=value`)."""
    for token in argv:
        if token == "--":
            return
        message = removed_message(token.split("=", 1)[0])
        if message is not None:
            raise ConfigError(message)
