"""The train.py command of a slime launch script, as bash would run it for a given environment, without running it.

slime's scripts set variables and bash arrays of flags (`MODEL_ARGS=( ... )`), `source` a model file, branch on
the environment and the hardware (`if [ "$NVLINK_COUNT" -gt 0 ]`), and end with one
`ray job submit --runtime-env-json=... -- python3 train.py ${ARRAY[@]} ...`. lichen.port_slime.bash_eval evaluates the
script statically for `environ` plus `--assume NAME=VALUE`; the first `python* train.py` / `train_async.py`
command it reaches is the result. What it cannot compute and that matters here (a flag value, a Ray env var,
whether the command runs at all) is an Item of a `ScriptNotEvaluated` error, one per cause, each naming its line.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from lichen.errors import ConfigError
from lichen.port_slime.bash_builtins import Finished, ScriptExit
from lichen.port_slime.bash_eval import Shell
from lichen.port_slime.bash_values import Assumptions, Item, Unknown, UnknownWord

_ENTRY = re.compile(r"(?:^|/)(?P<entry>train(?:_async)?\.py)$")


@dataclass
class SlimeCommand:
    """What the script runs: the entry point, its arguments after expansion, and Ray's runtime env vars."""

    script: str
    entry: str
    argv: list[str]
    env_vars: dict[str, str] = field(default_factory=dict)
    unset_vars: list[str] = field(default_factory=list)  # referenced but set nowhere: expanded to nothing
    where: str = ""  # script:line of the command
    ray_job: bool = True  # `ray job submit ... -- python3 train.py` (else a plain `python3 train.py`)


class ScriptNotEvaluated(ConfigError):
    """What port-slime could not evaluate; `items` has one entry per cause."""

    def __init__(self, script: str, items: list[Item]) -> None:
        self.items = items
        super().__init__(
            f"{script}: port-slime cannot evaluate {len(items)} thing(s) the converted config depends on: "
            + " | ".join(item.message() for item in items)
        )


def read_script(path: str, environ: dict[str, str] | None = None, assume: Assumptions | None = None) -> SlimeCommand:
    """The train.py / train_async.py command of slime launch script `path` for `environ` (default: os.environ)
    and `assume`; a script it cannot evaluate is ScriptNotEvaluated, one without the command a ConfigError."""
    found: list[SlimeCommand] = []
    shell = Shell(dict(os.environ if environ is None else environ), assume or Assumptions(), lambda *a: None)
    shell.on_command = lambda words, where, shadow: _on_command(shell, found, words, where, shadow)
    try:
        shell.run_file(path)
    except Finished:
        pass
    except ScriptExit as e:
        if shell.items:
            raise ScriptNotEvaluated(path, shell.items) from None
        raise ConfigError(
            f"{e.where}: the script exits here (exit {e.code}) before its train.py command, as bash would with this "
            "environment; set what it checks (in the environment or with --assume NAME=VALUE)"
        ) from None
    if shell.items:
        raise ScriptNotEvaluated(path, shell.items)
    if not found:
        raise ConfigError(
            f"{path}: no `python3 train.py ...` / `train_async.py` command found; give a slime "
            "launch script (scripts/run-*.sh)"
        )
    found[0].unset_vars = sorted(shell.unset_names)
    return found[0]


def _on_command(shell: Shell, found: list[SlimeCommand], words: list, where: str, shadow: Unknown | None) -> None:
    for i, word in enumerate(words):
        m = _ENTRY.search(word) if isinstance(word, str) else None
        prev = words[i - 1] if i else None
        if m and isinstance(prev, str) and os.path.basename(prev).startswith("python"):
            break
    else:
        return
    if shadow is not None:
        shell.item("whether the train.py command here runs", shadow)
        return
    before, argv = words[: i - 1], words[i + 1 :]
    for k, word in enumerate(argv):
        if isinstance(word, UnknownWord):
            flag = argv[k - 1] if k and isinstance(argv[k - 1], str) and argv[k - 1].startswith("--") else None
            what = f"the value of {flag}" if flag and not word.raw.startswith("${") else f"`{word.raw}`"
            shell.item(f"{what} in the train.py command", word.unknown)
    for word in before:
        if isinstance(word, UnknownWord):
            shell.item(f"`{word.raw}` of `ray job submit` (Ray's env vars for the training job)", word.unknown)
    if shell.items:
        raise Finished()
    found.append(
        SlimeCommand(
            shell.where,
            m.group("entry"),
            list(argv),
            _runtime_env(before, where),
            where=where,
            ray_job="submit" in before and any(os.path.basename(w) == "ray" for w in before),
        )
    )
    raise Finished()


def _runtime_env(ray_words: list[str], where: str) -> dict[str, str]:
    """env_vars of `ray job submit --runtime-env-json=JSON` (or `--runtime-env-json JSON`)."""
    for i, word in enumerate(ray_words):
        text = None
        if word.startswith("--runtime-env-json="):
            text = word.split("=", 1)[1]
        elif word == "--runtime-env-json" and i + 1 < len(ray_words):
            text = ray_words[i + 1]
        if text is not None:
            try:
                env = json.loads(text).get("env_vars", {})
            except (ValueError, AttributeError):
                raise ConfigError(f"{where}: --runtime-env-json is not a JSON object: {text[:80]!r}") from None
            return {str(k): str(v) for k, v in env.items()}
    return {}
