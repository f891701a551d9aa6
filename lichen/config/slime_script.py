"""Read a slime launch script (bash) far enough to recover the flags it hands to train.py.

slime's scripts follow one shape: variables and bash arrays of flags (`MODEL_ARGS=( ... )`), `source` of a model
file next to the script, and one `ray job submit ... -- python3 train.py ${ARRAY[@]} ...` (sometimes a plain
`python3 train.py ...`). This reader understands exactly that: statements split as bash splits them (quotes,
comments, line continuations, multi-line arrays and strings), `NAME=value` / `export NAME=value`,
`NAME=( ... )`, `$NAME` / `${NAME}` / `${NAME:-default}` / `${NAME[@]}` / `$(( arithmetic ))`, the
`SCRIPT_DIR=$(cd ... dirname ${BASH_SOURCE[0]} ...)` idiom, and `source FILE` / `. FILE` relative to the script. A
variable set neither in the script nor in the environment expands to nothing, as in bash, and is reported.
Other commands (pkill, ray start, if/fi, echo) are skipped; `$( ... )` of anything else is not run.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from lichen.errors import ConfigError

_VAR = re.compile(
    r"\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?::-(?P<default>[^}]*))?\}"
    r"|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))"
)
_ARRAY_REF = re.compile(r"^\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)\[[@*]\]\}$")
_ARITH = re.compile(r"\$\(\((?P<expr>[^()]*)\)\)")
_ASSIGN = re.compile(r"^(?:export\s+)?(?P<name>[A-Za-z_][A-Za-z0-9_]*)=(?P<rest>.*)$", re.S)
_ENTRY = re.compile(r"(?:^|/)(?P<entry>train(?:_async)?\.py)$")


@dataclass
class SlimeCommand:
    """What the script runs: the entry point, its arguments after expansion, and Ray's runtime env vars."""

    script: str
    entry: str
    argv: list[str]
    env_vars: dict[str, str] = field(default_factory=dict)
    unset_vars: list[str] = field(default_factory=list)  # referenced but set nowhere: expanded to nothing


def read_script(path: str, environ: dict[str, str] | None = None) -> SlimeCommand:
    """The train.py / train_async.py command of slime launch script `path`; a script without one is a
    ConfigError naming the file."""
    reader = _Reader(dict(os.environ if environ is None else environ))
    reader.run_file(path)
    if reader.command is None:
        raise ConfigError(
            f"{path}: no `python3 train.py ...` / `train_async.py` command found; give a slime "
            "launch script (scripts/run-*.sh)"
        )
    reader.command.unset_vars = sorted(reader.unset)
    return reader.command


class _Reader:
    def __init__(self, environ: dict[str, str]) -> None:
        self.environ = environ
        self.vars: dict[str, str] = {}
        self.arrays: dict[str, list[str]] = {}
        self.unset: set[str] = set()
        self.command: SlimeCommand | None = None
        self.script = ""

    def run_file(self, path: str) -> None:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the script: {e.strerror}") from None
        outer, self.script = self.script, os.path.abspath(path)
        for statement in split_statements(text):
            self.run(statement, os.path.dirname(self.script))
        self.script = outer or self.script

    def run(self, statement: str, script_dir: str) -> None:
        m = _ASSIGN.match(statement)
        if m and not re.search(r"\s", m.group("name")):
            self._assign(m.group("name"), m.group("rest").strip(), script_dir)
            return
        words = self.words(statement)
        if not words:
            return
        if words[0] in ("source", ".") and len(words) > 1:
            target = words[1] if os.path.isabs(words[1]) else os.path.join(script_dir, words[1])
            self.run_file(target)
            return
        self._maybe_command(words)

    def _assign(self, name: str, rest: str, script_dir: str) -> None:
        if rest.startswith("("):
            self.arrays[name] = self.words(rest[1 : rest.rindex(")")] if ")" in rest else rest[1:])
        elif "BASH_SOURCE" in rest:  # SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
            self.vars[name] = script_dir
        elif "$(" in rest and not rest.startswith("$(("):
            self.vars[name] = ""  # a command substitution (nvidia-smi, ...): not run
        else:
            value, _ = self._word(rest)
            self.vars[name] = value

    def expand(self, text: str) -> str:
        text = _ARITH.sub(lambda m: str(_arith(self._names(self.expand(m.group("expr"))), m.group(0))), text)
        return _VAR.sub(self._value, text)

    def _names(self, expr: str) -> str:
        """Bare variable names inside $(( )) (bash arithmetic reads them without $)."""
        return re.sub(
            r"[A-Za-z_][A-Za-z0-9_]*", lambda m: self.vars.get(m.group(0), self.environ.get(m.group(0), "0")), expr
        )

    def _value(self, m: re.Match) -> str:
        name = m.group("braced") or m.group("plain")
        if name in self.vars:
            return self.vars[name]
        if name in self.environ:
            return self.environ[name]
        if m.group("default") is not None:
            return m.group("default").strip("\"'")
        self.unset.add(name)
        return ""

    def words(self, text: str) -> list[str]:
        """Bash words of `text`: `${ARRAY[@]}` spliced, quotes removed after expansion, unquoted expansions split
        on whitespace and dropped when empty (as bash does)."""
        out: list[str] = []
        for raw in _raw_words(text):
            ref = _ARRAY_REF.match(raw.strip('"'))
            if ref:
                out += self.arrays.get(ref.group("name"), [])
                continue
            value, quoted = self._word(raw)
            out += [value] if quoted else value.split()
        return out

    def _word(self, raw: str) -> tuple[str, bool]:
        """One word's value: single quotes literal, double quotes expanded with their escapes, the rest expanded."""
        out: list[str] = []
        quoted = False
        i = 0
        while i < len(raw):
            c = raw[i]
            if c == "'":
                j = raw.find("'", i + 1)
                j = len(raw) if j < 0 else j
                out.append(raw[i + 1 : j])
                quoted, i = True, j + 1
            elif c == '"':
                seg: list[str] = []
                j = i + 1
                while j < len(raw) and raw[j] != '"':
                    if raw[j] == "\\" and raw[j + 1 : j + 2] in ('"', "\\", "$", "`"):
                        j += 1
                    seg.append(raw[j])
                    j += 1
                out.append(self.expand("".join(seg)))
                quoted, i = True, j + 1
            elif c == "\\" and i + 1 < len(raw):
                out.append(raw[i + 1])
                i += 2
            else:
                j = i
                while j < len(raw) and raw[j] not in "'\"\\":
                    j += 1
                out.append(self.expand(raw[i:j]))
                i = j
        return "".join(out), quoted

    def _maybe_command(self, words: list[str]) -> None:
        for i, word in enumerate(words):
            m = _ENTRY.search(word)
            if m and i > 0 and os.path.basename(words[i - 1]).startswith("python"):
                env = _runtime_env(words[:i], self.script)
                self.command = SlimeCommand(self.script, m.group("entry"), words[i + 1 :], env)
                return


def _arith(expr: str, where: str) -> int:
    if not re.fullmatch(r"[0-9+\-*/ ()]*", expr):
        raise ConfigError(f"{where}: only integer arithmetic is understood in $(( ))")
    return int(eval(expr, {"__builtins__": {}}))  # digits and + - * / only, checked above


def _runtime_env(ray_words: list[str], script: str) -> dict[str, str]:
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
                raise ConfigError(f"{script}: --runtime-env-json is not a JSON object: {text[:80]!r}") from None
            return {str(k): str(v) for k, v in env.items()}
    return {}


def split_statements(text: str) -> list[str]:
    """Bash statements of `text`: newlines and `;` end one unless quoted, escaped or inside `( )`; comments go."""
    out: list[str] = []
    buf: list[str] = []
    quote = ""
    depth = 0
    i = 0
    while i < len(text):
        c = text[i]
        if quote:
            buf.append(c)
            if c == "\\" and quote == '"' and i + 1 < len(text):
                buf.append(text[i + 1])
                i += 1
            elif c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
            buf.append(c)
        elif c == "\\" and text[i + 1 : i + 2] == "\n":
            buf.append(" ")
            i += 1
        elif c == "#" and (not buf or buf[-1] in " \t\n("):
            while i < len(text) and text[i] != "\n":
                i += 1
            continue
        elif c == "(":
            depth += 1
            buf.append(c)
        elif c == ")":
            depth = max(0, depth - 1)
            buf.append(c)
        elif c in "\n;" and depth == 0:
            out.append("".join(buf).strip())
            buf = []
        else:
            buf.append(c)
        i += 1
    out.append("".join(buf).strip())
    return [s for s in out if s]


def _raw_words(text: str) -> list[str]:
    """Split on unquoted whitespace, keeping quotes (expansion needs to know what was quoted)."""
    words: list[str] = []
    buf: list[str] = []
    quote = ""
    escaped = False
    depth = 0  # inside $( ) or $(( )): spaces do not split
    for c in text:
        if escaped:
            buf.append(c)
            escaped = False
        elif depth and c in "()":
            depth += 1 if c == "(" else -1
            buf.append(c)
        elif c == "(" and buf and buf[-1] == "$":
            depth = 1
            buf.append(c)
        elif depth:
            buf.append(c)
        elif quote:
            buf.append(c)
            if c == "\\" and quote == '"':
                escaped = True
            elif c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
            buf.append(c)
        elif c.isspace():
            if buf:
                words.append("".join(buf))
                buf = []
        else:
            buf.append(c)
    if buf:
        words.append("".join(buf))
    return words
