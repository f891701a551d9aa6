"""The one redaction rule: which config fields and environment variables hold secrets, and how they are hidden.

A name holds a secret when, split into words at `_`, `-` and `.` (case ignored),
- one word is `secret(s)`, `password`, `passwd`, `passphrase`, `credential(s)` or `apikey`; or
- its last word is `key`/`keys` (`wandb_key`, `rollout_external_engine_api_key`, `WANDB_API_KEY`) or `token`
  (`hf_token`), unless the word before names what the key or token is rather than guarding something: the data
  fields `input_key`, `label_key`, `reward_key`, … and tokenizer tokens such as `pad_token`.
A path to a key file (`--…-api-key-file`) is not itself a secret and stays visible.

`redact_config` returns a copy of a config (dicts, lists, argv-style lists) with every secret value replaced by
REDACTED: values under secret names, the argument after a secret flag (`--api-key X`, `--api-key=X`) in lists
such as `--sglang-*` pass-through arguments, and any registered secret inside a string. `register_secrets` records
the secret values of a config and of the environment, so that `redact_text` can scrub them from free text (log
lines, error messages, `sys.argv` as W&B records it); values shorter than MIN_SCRUB_LEN are redacted in config
fields but not searched for in free text, where they would blank out ordinary words and numbers.
"""

from __future__ import annotations

import os
import re
import threading
from typing import Any, Iterable, Mapping

REDACTED = "<redacted>"
MIN_SCRUB_LEN = 6

_SECRET_WORDS = frozenset(
    {"secret", "secrets", "password", "passwd", "passphrase", "credential", "credentials", "apikey"}
)
# words before a final key/token that make it a name of data, not a credential
_NOT_SECRET_BEFORE = frozenset(
    {
        "input",
        "label",
        "metadata",
        "tool",
        "tools",
        "reward",
        "sort",
        "group",
        "dict",
        "column",
        "cache",
        "primary",
        "foreign",
        "partition",
        "lookup",
        "seed",
        "rng",
        "pad",
        "eos",
        "bos",
        "unk",
        "sep",
        "cls",
        "mask",
        "stop",
        "special",
        "start",
        "end",
        "image",
        "audio",
        "video",
    }
)

_lock = threading.Lock()
_registered: set[str] = set()


def is_secret_name(name: str) -> bool:
    """Whether a config field, flag (`--wandb-key`) or environment variable of this name holds a secret."""
    words = [w for w in re.split(r"[_\-.\s]+", name.strip("-").lower()) if w]
    if not words:
        return False
    if any(w in _SECRET_WORDS for w in words):
        return True
    if words[-1] in ("key", "keys", "token"):
        return len(words) == 1 or words[-2] not in _NOT_SECRET_BEFORE
    return False


def _is_set(value: Any) -> bool:
    return value is not None and value != "" and value is not False


def redact_config(value: Any) -> Any:
    """A copy of `value` with every secret replaced by REDACTED (see the module docstring)."""
    if isinstance(value, Mapping):
        return {k: (REDACTED if is_secret_name(str(k)) and _is_set(v) else redact_config(v)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        out = _redact_argv([redact_config(v) for v in value])
        return type(value)(out) if isinstance(value, tuple) else out
    if isinstance(value, str):
        return redact_text(value)
    return value


def _redact_argv(items: list) -> list:
    """`--secret-flag VALUE` and `--secret-flag=VALUE` in an argv-style list get VALUE redacted."""
    out = list(items)
    for i, item in enumerate(out):
        if not isinstance(item, str) or not item.startswith("-"):
            continue
        flag, eq, rest = item.partition("=")
        if not is_secret_name(flag):
            continue
        if eq:
            out[i] = f"{flag}={REDACTED}"
        elif i + 1 < len(out) and isinstance(out[i + 1], str) and not out[i + 1].startswith("--"):
            out[i + 1] = REDACTED
    return out


def secret_values(value: Any) -> set[str]:
    """Every secret string that `redact_config` would hide in `value`."""
    found: set[str] = set()

    def walk(v: Any, secret: bool) -> None:
        if isinstance(v, Mapping):
            for k, item in v.items():
                walk(item, secret or is_secret_name(str(k)))
        elif isinstance(v, (list, tuple)):
            items = list(v)
            for i, item in enumerate(items):
                walk(item, secret)
                if isinstance(item, str) and item.startswith("-"):
                    flag, eq, rest = item.partition("=")
                    if is_secret_name(flag):
                        if eq:
                            found.add(rest)
                        elif i + 1 < len(items) and isinstance(items[i + 1], str):
                            found.add(items[i + 1])
        elif secret and _is_set(v) and not isinstance(v, bool):
            found.add(str(v))

    walk(value, False)
    return {s for s in found if s and s != REDACTED}


def register_secrets(config: Any = None, environ: Mapping[str, str] | None = None) -> None:
    """Remember the secret values of `config` and of the environment (`os.environ` unless given) for
    `redact_text`. Called once the flags are parsed; safe to call again (values accumulate)."""
    env = os.environ if environ is None else environ
    values = secret_values(config) if config is not None else set()
    values |= {v for k, v in env.items() if is_secret_name(k) and v}
    add_secrets(values)


def add_secrets(values: Iterable[str]) -> None:
    """Remember secret values read elsewhere (a key file, a generated engine key)."""
    with _lock:
        _registered.update(str(v) for v in values if v)


def redact_text(text: str) -> str:
    """`text` with every registered secret of at least MIN_SCRUB_LEN characters replaced by REDACTED."""
    with _lock:
        secrets = sorted((s for s in _registered if len(s) >= MIN_SCRUB_LEN), key=len, reverse=True)
    for secret in secrets:
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


def redact_argv(argv: list[str]) -> list[str]:
    """`argv` with secret flag values and registered secrets redacted (W&B records `sys.argv` of a run)."""
    return [redact_text(a) for a in _redact_argv(list(argv))]


def forget_secrets() -> None:
    """Drop every registered secret (tests)."""
    with _lock:
        _registered.clear()
