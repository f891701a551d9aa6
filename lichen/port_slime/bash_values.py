"""Values of port-slime's static bash evaluator: what is known, what is not and why, and the --assume settlements.

A value the evaluator cannot compute (a command's output, a branch it cannot decide, a file test on the machine that
runs the script) is an `Unknown` that carries one sentence saying why and the `--assume` settings that would settle
it. It travels through assignments like a value; only where it matters (the train.py command, Ray's env vars, a
`source` path, an `exit`) does it become an `Item` of the report.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lichen.errors import ConfigError

FILE_TESTS = ("-e", "-f", "-d", "-s", "-r", "-w", "-x", "-L", "-h")
_TRUE = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


@dataclass(frozen=True)
class Unknown:
    """A value port-slime cannot compute statically."""

    why: str  # the root cause, one sentence without a final period
    settle: tuple[str, ...] = ()  # --assume settings that settle it, e.g. "NVLINK_COUNT=VALUE"

    def via(self, name: str) -> "Unknown":
        """The same cause, reached through variable `name` (which --assume can then also settle)."""
        hint = f"{name}=VALUE"
        return self if hint in self.settle else Unknown(self.why, self.settle + (hint,))


class Unknowable(Exception):
    """Raised where an expansion meets an Unknown; caught where the value stops mattering or becomes an Item."""

    def __init__(self, unknown: Unknown) -> None:
        super().__init__(unknown.why)
        self.unknown = unknown


Value = str | list[str] | Unknown


@dataclass(frozen=True)
class UnknownWord:
    """A word of a command that cannot be expanded: the word as written, and why."""

    raw: str
    unknown: Unknown


@dataclass(frozen=True)
class Item:
    """One thing the conversion could not evaluate, at a script line."""

    where: str
    what: str
    unknown: Unknown | None = None

    def message(self) -> str:
        text = f"{self.where}: {self.what}"
        if self.unknown is not None:
            text += f": {self.unknown.why}"
            if self.unknown.settle:
                text += "; settle it with " + " or ".join(f"--assume {s}" for s in self.unknown.settle)
        return text


@dataclass
class Assumptions:
    """`--assume NAME=VALUE` (a variable's value where port-slime cannot compute it, and in the environment) and
    `--assume '-f PATH=true'` (the answer of a file test)."""

    names: dict[str, str] = field(default_factory=dict)
    files: dict[tuple[str, str], bool] = field(default_factory=dict)

    @classmethod
    def parse(cls, settings: list[str]) -> "Assumptions":
        out = cls()
        for setting in settings:
            key, eq, value = setting.partition("=")
            op, _, path = key.partition(" ")
            if eq and op in FILE_TESTS and path.strip():
                if value.strip().lower() not in _TRUE:
                    raise ConfigError(f"--assume {setting!r}: a file test takes =true or =false")
                out.files[(op, path.strip())] = _TRUE[value.strip().lower()]
            elif eq and key.isidentifier():
                out.names[key] = value
            else:
                raise ConfigError(
                    f"--assume {setting!r}: give NAME=VALUE (a variable) or '-f PATH=true' (a file test: "
                    f"{', '.join(FILE_TESTS)})"
                )
        return out
