"""The bash builtins port-slime's evaluator runs (lichen.port_slime.bash_eval): those that change the shell's variables,
directory or control flow, and those whose output `$( )` may need. Every other command is not run.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Callable

from lichen.port_slime import bash_syntax as syn
from lichen.port_slime.bash_test import TestShell
from lichen.port_slime.bash_values import Unknowable, Unknown

if TYPE_CHECKING:
    from lichen.port_slime.bash_eval import State

BUILTINS = {
    "echo": "_b_echo",
    "printf": "_b_printf",
    "cat": "_b_cat",
    "pwd": "_b_pwd",
    "cd": "_b_cd",
    "dirname": "_b_dirname",
    "basename": "_b_basename",
    "seq": "_b_seq",
    "source": "_b_source",
    ".": "_b_source",
    "exit": "_b_exit",
    "return": "_b_exit",
    "break": "_b_loop",
    "continue": "_b_loop",
    "unset": "_b_unset",
    "let": "_b_let",
    "test": "_b_test",
    "[": "_b_test",
    "false": "_b_false",
    "eval": "_b_eval",
    "read": "_b_read",
    "mapfile": "_b_read",
    "readarray": "_b_read",
}
_SPEC = re.compile(r"%(?:%|[-+ #0]*\d*(?:\.\d+)?[sbdiouxXcfeEgG])")
_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\", '"': '"', "'": "'", "a": "\a", "r": "\r", "e": "\x1b", "0": "\0"}


class Finished(Exception):
    """Raised by the evaluator's `on_command` to end the evaluation (the command of interest was found)."""


class ScriptExit(Exception):
    """`exit N` (or `return` outside a function): bash stops here."""

    def __init__(self, code: str, where: str) -> None:
        super().__init__(code)
        self.code, self.where = code, where


class EndBranch(Exception):
    """Ends a branch evaluated in the shadow (it exits: the report says so)."""


class LoopControl(Exception):
    def __init__(self, kind: str, levels: int) -> None:
        super().__init__(kind)
        self.kind, self.levels = kind, levels


class Builtins(TestShell):
    """Mixin of lichen.port_slime.bash_eval.Shell; each `_b_*` takes the argument words and the command node."""

    # given by Shell
    state: State
    shadow: Unknown | None
    command_name: str

    def emit(self, text: str, unknown: Unknown | None = None) -> None:
        raise NotImplementedError

    def item(self, what: str, unknown: Unknown | None = None) -> None:
        raise NotImplementedError

    def here(self) -> str:
        raise NotImplementedError

    def run_file(self, path: str) -> None:
        raise NotImplementedError

    def assign_word(self, raw: str) -> None:
        raise NotImplementedError

    def _external(self, words: list[syn.Word], node: syn.Simple) -> None:
        raise NotImplementedError

    def _stdout_redirected(self, node: syn.Simple) -> bool:
        raise NotImplementedError

    def _args(self, args: list[syn.Word]) -> list[str]:
        return [w for word in args for w in self.fields(word.raw)]

    def _print(self, render: Callable[[], str]) -> None:
        try:
            text = render()
        except Unknowable as e:
            self.emit("", e.unknown)
        else:
            self.emit(text)
        self.state.status = 0

    def _b_echo(self, args: list[syn.Word], node: syn.Simple) -> None:
        def render() -> str:
            words, newline, escapes = self._args(args), True, False
            while words and re.fullmatch(r"-[neE]+", words[0]):
                newline = newline and "n" not in words[0]
                escapes = "e" in words[0] or (escapes and "E" not in words[0])
                words = words[1:]
            text = " ".join(words)
            return (_unescape(text) if escapes else text) + ("\n" if newline else "")

        if not self._stdout_redirected(node):
            self._print(render)
        self.state.status = 0

    def _b_printf(self, args: list[syn.Word], node: syn.Simple) -> None:
        words = self._args(args)
        target = None
        if len(words) >= 2 and words[0] == "-v":
            target, words = words[1], words[2:]
        if words and words[0] == "--":
            words = words[1:]
        if not words:
            self.state.status = 2
            return
        text = printf(words[0], words[1:])
        if target is not None:
            self.assign_word(f"{target}={_quote(text)}")
        elif not self._stdout_redirected(node):
            self.emit(text)
        self.state.status = 0

    def _b_cat(self, args: list[syn.Word], node: syn.Simple) -> None:
        docs = [r for r in node.redirects if r.op in ("<<", "<<-", "<<<")]
        if args or not docs:
            self._external([syn.Word("cat", node.line)] + args, node)
            return
        doc = docs[-1]

        def render() -> str:
            if doc.op == "<<<":
                return self.one(doc.target) + "\n"
            return self.one(doc.body or "", heredoc=True) if doc.expand else doc.body or ""

        if not self._stdout_redirected(node):
            self._print(render)
        self.state.status = 0

    def _b_pwd(self, args: list[syn.Word], node: syn.Simple) -> None:
        if not self._stdout_redirected(node):
            self.emit(self.state.cwd + "\n")
        self.state.status = 0

    def _b_cd(self, args: list[syn.Word], node: syn.Simple) -> None:
        words = [w for w in self._args(args) if w not in ("--", "-P", "-L")]
        target = words[0] if words else self.home()
        path = os.path.normpath(os.path.join(self.state.cwd, target))
        ok = os.path.isdir(path)  # the script's own directory (SCRIPT_DIR): a file of this machine
        if ok:
            self.state.cwd = path
        self.state.status = 0 if ok else 1

    def _b_dirname(self, args: list[syn.Word], node: syn.Simple) -> None:
        def render() -> str:
            words = [w for w in self._args(args) if w != "--"]
            return "".join(_dirname(w) + "\n" for w in words)

        self._print(render)

    def _b_basename(self, args: list[syn.Word], node: syn.Simple) -> None:
        def render() -> str:
            words = [w for w in self._args(args) if w != "--"]
            if not words:
                return ""
            base = os.path.basename(words[0].rstrip("/")) or "/"
            if len(words) > 1 and base.endswith(words[1]) and base != words[1]:
                base = base[: -len(words[1])]
            return base + "\n"

        self._print(render)

    def _b_seq(self, args: list[syn.Word], node: syn.Simple) -> None:
        """coreutils seq with integers: [FIRST [STEP]] LAST, one number a line (deterministic, so evaluated)."""

        def render() -> str:
            words = self._args(args)
            if not 1 <= len(words) <= 3 or not all(re.fullmatch(r"[-+]?\d+", w) for w in words):
                raise Unknowable(Unknown(f"`seq {' '.join(words)}` ({self.here()}): only integer seq is evaluated"))
            numbers = [int(w) for w in words]
            first, step, last = (
                (1, 1, numbers[0])
                if len(numbers) == 1
                else ((numbers[0], 1, numbers[1]) if len(numbers) == 2 else tuple(numbers))
            )
            if step == 0:
                raise Unknowable(Unknown(f"`seq` with step 0 ({self.here()}) never ends"))
            stop = last + (1 if step > 0 else -1)
            return "".join(f"{n}\n" for n in range(first, stop, step))

        if not self._stdout_redirected(node):
            self._print(render)

    def _b_source(self, args: list[syn.Word], node: syn.Simple) -> None:
        try:
            words = self._args(args)
        except Unknowable as e:
            self.item("the file `source` reads", e.unknown)
            self.state.status = e.unknown
            return
        if not words:
            raise self.fail("`source` needs a file name")
        path = _source_path(words[0], self.state.cwd, self.where)
        if path is None:
            self.item(f"`source {words[0]}`: no such file in the current directory, next to the script or above it")
            self.state.status = 1
            return
        line = self.line
        try:
            self.run_file(path)
        finally:
            self.line = line

    def _b_exit(self, args: list[syn.Word], node: syn.Simple) -> None:
        try:
            words = self._args(args)
        except Unknowable:
            words = ["?"]
        code = words[0] if words else "0"
        if self.shadow is not None:
            self.item(f"whether the script exits here (exit {code})", self.shadow)
            raise EndBranch()
        raise ScriptExit(code, self.here())

    def _b_loop(self, args: list[syn.Word], node: syn.Simple) -> None:
        words = self._args(args)
        levels = int(words[0]) if words and words[0].isdigit() else 1
        raise LoopControl(self.fields(node.words[0].raw)[0], levels)

    def _b_unset(self, args: list[syn.Word], node: syn.Simple) -> None:
        for name in self._args(args):
            if not name.startswith("-"):
                self.state.vars.pop(name, None)
                self.state.funcs.pop(name, None)
        self.state.status = 0

    def _b_let(self, args: list[syn.Word], node: syn.Simple) -> None:
        value = 0
        for word in self._args(args):
            value = self.arith(word)
        self.state.status = int(value == 0)

    def _b_test(self, args: list[syn.Word], node: syn.Simple) -> None:
        self.state.status = self.bracket(args, self.command_name == "[")

    def _b_false(self, args: list[syn.Word], node: syn.Simple) -> None:
        self.state.status = 1

    def _b_eval(self, args: list[syn.Word], node: syn.Simple) -> None:
        self.item("`eval` is not evaluated by port-slime; write the command out")
        self.state.status = Unknown(f"the `eval` at {self.here()}, which port-slime does not evaluate")

    def _b_read(self, args: list[syn.Word], node: syn.Simple) -> None:
        why = Unknown(f"`{node.words[0].raw}` at {self.here()} reads input port-slime does not have")
        for word in args:
            if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", word.raw):
                self.state.vars[word.raw] = self.assume.names.get(word.raw, why.via(word.raw))
        self.state.status = why


def _source_path(name: str, cwd: str, script: str) -> str | None:
    """Where `source NAME` finds its file: as bash, an absolute path or one relative to the current directory;
    failing that, relative to the script's directory or one above it (slime runs `bash scripts/run-x.sh` from its
    repository root, so `source scripts/models/m.sh` is relative to the script's parent)."""
    if os.path.isabs(name):
        return name if os.path.isfile(name) else None
    here = os.path.dirname(os.path.abspath(script))
    for base in [cwd, here, *_parents(here)]:
        if os.path.isfile(os.path.join(base, name)):
            return os.path.join(base, name)
    return None


def _parents(path: str) -> list[str]:
    out = []
    while os.path.dirname(path) != path:
        path = os.path.dirname(path)
        out.append(path)
    return out


def _dirname(path: str) -> str:
    stripped = path.rstrip("/")
    if not stripped:
        return "/" if path else "."
    head = os.path.dirname(stripped).rstrip("/")
    return head if head else ("/" if stripped.startswith("/") else ".")


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), "\\" + m.group(1)), text)


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def printf(fmt: str, args: list[str]) -> str:
    """bash's printf: the format is reused while arguments remain; a missing argument is empty (or 0)."""
    out: list[str] = []
    rest = list(args)
    while True:
        used = 0

        def convert(m: re.Match) -> str:
            nonlocal used
            spec = m.group(0)
            if spec == "%%":
                return "%"
            arg = rest[used] if used < len(rest) else ""
            used += 1
            kind = spec[-1]
            if kind in "sb":
                return (spec[:-1] + "s") % (_unescape(arg) if kind == "b" else arg)
            if kind == "c":
                return arg[:1]
            try:
                if kind in "diouxX":
                    return (spec[:-1] + ("d" if kind in "iu" else kind)) % int(arg or "0", 10)
                return spec % float(arg or 0)
            except ValueError:  # bash: "invalid number", prints 0
                return (spec[:-1] + "d") % 0 if kind in "diouxX" else spec % 0.0

        pieces = _SPEC.split(fmt)
        specs = _SPEC.findall(fmt)
        text = _unescape(pieces[0])
        for spec, piece in zip(specs, pieces[1:]):
            text += _SPEC.sub(convert, spec) + _unescape(piece)
        out.append(text)
        rest = rest[used:]
        if not rest or used == 0:
            return "".join(out)
