"""Conditions of port-slime's static bash evaluator: `[ ... ]` / `test ...` and `[[ ... ]]`.

Strings (`=`, `==`, `!=`, `-z`, `-n`, a bare word), integers (`-eq -ne -gt -lt -ge -le`; in `[[ ]]` their operands
are arithmetic), `!`, `-a` / `-o`, `&&` / `||`, parentheses, `[[ == ]]` glob patterns and `=~`, `-v NAME`. A file
test (`-f`, `-d`, `-e`, ...) asks about the machine that runs the script, so it is Unknown unless
`--assume '-f PATH=true'` answers it. A variable the condition reads that is set neither by the script nor in the
environment is Unknown too (strict expansion): the run's environment decides it, so the user must say.
"""

from __future__ import annotations

import fnmatch
import re

from lichen.port_slime import bash_syntax as syn
from lichen.port_slime.bash_expand import Expander
from lichen.port_slime.bash_values import FILE_TESTS, Assumptions, Unknowable, Unknown

_INT_OPS = {
    "-eq": lambda a, b: a == b,
    "-ne": lambda a, b: a != b,
    "-gt": lambda a, b: a > b,
    "-lt": lambda a, b: a < b,
    "-ge": lambda a, b: a >= b,
    "-le": lambda a, b: a <= b,
}
_STR_OPS = ("=", "==", "!=")
_UNARY = ("-z", "-n", "-v", *FILE_TESTS)


class BashError(Exception):
    """A condition bash rejects: it prints an error and the test's status is 2."""


class TestShell(Expander):
    assume: Assumptions

    def bracket(self, args: list[syn.Word], closing: bool) -> int | Unknown:
        """Status of `[ args ]` (closing: the last word must be `]`) or `test args`."""
        try:
            words = [w for word in args for w in self.fields(word.raw, strict=True)]
            if closing:
                if not words or words[-1] != "]":
                    return 2
                words = words[:-1]
            return 0 if _Eval(self, words, None).run() else 1
        except Unknowable as e:
            return e.unknown
        except BashError:
            return 2

    def cond(self, parts: list[syn.Word | str]) -> int | Unknown:
        """Status of `[[ parts ]]`: no word splitting; unquoted right-hand sides of == / != are patterns."""
        try:
            words = [p if isinstance(p, str) else self.one(p.raw, strict=True) for p in parts]
            raws = [p if isinstance(p, str) else p.raw for p in parts]
            return 0 if _Eval(self, words, raws).run() else 1
        except Unknowable as e:
            return e.unknown
        except BashError:
            return 2

    def file_test(self, op: str, path: str) -> bool:
        answer = self.assume.files.get((op, path))
        if answer is None:
            raise Unknowable(
                Unknown(
                    f"`[ {op} {path} ]` ({self.where}:{self.line}) asks about the file system of the machine that "
                    "runs the script",
                    (f"'{op} {path}=true' (or =false)",),
                )
            )
        return answer


class _Eval:
    """Recursive descent over the words of one condition; raws (for `[[ ]]`) tell quoted from pattern."""

    def __init__(self, shell: TestShell, words: list[str], raws: list[str] | None) -> None:
        self.shell, self.words, self.raws, self.i = shell, words, raws, 0
        self.double = raws is not None
        self.or_ops = ("||",) if self.double else ("-o",)
        self.and_ops = ("&&",) if self.double else ("-a",)

    def run(self) -> bool:
        if not self.words:
            return False
        value = self.or_()
        if self.i != len(self.words):
            raise BashError(f"unexpected {self.words[self.i]!r}")
        return value

    def peek(self, k: int = 0) -> str | None:
        return self.words[self.i + k] if self.i + k < len(self.words) else None

    def or_(self) -> bool:
        value = self.and_()
        while self.peek() in self.or_ops:
            self.i += 1
            right = self.and_()
            value = value or right
        return value

    def and_(self) -> bool:
        value = self.not_()
        while self.peek() in self.and_ops:
            self.i += 1
            right = self.not_()
            value = value and right
        return value

    def not_(self) -> bool:
        if self.peek() == "!" and self.peek(1) is not None:
            self.i += 1
            return not self.not_()
        return self.primary()

    def primary(self) -> bool:
        word = self.peek()
        if word is None:
            raise BashError("a condition is missing")
        if word == "(" and self.peek(1) is not None:
            self.i += 1
            value = self.or_()
            if self.peek() != ")":
                raise BashError("`(` without `)`")
            self.i += 1
            return value
        nxt = self.peek(1)
        if nxt is not None and (nxt in _INT_OPS or nxt in _STR_OPS or nxt == "=~") and self.peek(2) is not None:
            left, right, k = word, self.peek(2), self.i + 2
            self.i += 3
            return self.binary(left, nxt, right, k)  # type: ignore[arg-type]
        if word in _UNARY and nxt is not None:
            self.i += 2
            return self.unary(word, nxt)
        self.i += 1
        return word != ""

    def unary(self, op: str, arg: str) -> bool:
        if op == "-z":
            return arg == ""
        if op == "-n":
            return arg != ""
        if op == "-v":
            return self.shell.is_set(arg, None)
        return self.shell.file_test(op, arg)

    def binary(self, left: str, op: str, right: str, k: int) -> bool:
        if op in _INT_OPS:
            return _INT_OPS[op](self.integer(left), self.integer(right))
        if op == "=~":
            try:
                return re.search(right, left) is not None
            except re.error:
                raise BashError(f"=~ {right!r}: not a regular expression") from None
        raw = self.raws[k] if self.raws is not None else None
        if raw is not None and not re.search(r"[\"'\\]", raw) and re.search(r"[*?[]", right):
            same = fnmatch.fnmatchcase(left, right)
        else:
            same = left == right
        return same if op in ("=", "==") else not same

    def integer(self, text: str) -> int:
        if self.double:
            return self.shell.arith(text)
        if not re.fullmatch(r"\s*[-+]?\d+\s*", text):
            raise BashError(f"{text!r}: integer expression expected")
        return int(text)
