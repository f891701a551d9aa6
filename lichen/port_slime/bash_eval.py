"""A static bash evaluator for `lichen port-slime`: a launch script's variables, as bash would set them for a given
environment, without running any command (slime's scripts kill processes and start Ray).

Evaluated: assignments (`NAME=`, `+=`, arrays `NAME=( ... )`, `NAME[i]=`), `export` / `declare` / `readonly` /
`local` / `unset`, all expansions of lichen.port_slime.bash_expand, `if/elif/else`, `&&` / `||`, `!`, `[ ]` / `test` /
`[[ ]]` (lichen.port_slime.bash_test), `(( ))`, `let`, `for` over words and `for ((;;))`, `while` / `until`, `break` /
`continue`, `{ }`, `( )`, `source` / `.` (relative to the script), `exit`, and in `$( )` the builtins whose output is
known (`echo`, `printf`, `cat` of a here-document, `pwd` after `cd`, `dirname`, `basename`). Every other command is
not run: bash's other commands cannot change the shell's variables, so only their output and exit status are
unknown. A branch whose condition depends on such an unknown is evaluated both ways and the variables whose values
differ become `Unknown` (lichen.port_slime.bash_values); `case`, functions and `eval` are not evaluated.

`on_command(words, line, shadow)` receives every command that is not a builtin, its words expanded (an `Unknown` in
place of a word that cannot be computed); raising `Finished` ends the evaluation there.
"""

from __future__ import annotations

import os
import re
from functools import partial
from typing import Callable

from lichen.errors import ConfigError
from lichen.port_slime import bash_syntax as syn
from lichen.port_slime.bash_arith import ArithError, evaluate
from lichen.port_slime.bash_builtins import BUILTINS, Builtins, EndBranch, LoopControl, ScriptExit
from lichen.port_slime.bash_expand import Joined
from lichen.port_slime.bash_values import Assumptions, Item, Unknowable, Unknown, UnknownWord, Value

_ASSIGNMENT = re.compile(
    r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:\[(?P<index>[^]]*)\])?(?P<plus>\+?)=(?P<value>.*)$", re.S
)
_MAX_STEPS = 200_000  # loop iterations in all: a loop that runs longer is reported, not run forever
_QUIET = {"set", "shopt", "trap", "wait", "sleep", "ulimit", "umask", "hash", "shift", "alias", "true", ":"}
_DECLARE = {"export", "declare", "typeset", "local", "readonly"}
Hook = Callable[[list], None]


def _nothing() -> None:
    """The branch of an `if` / `&&` that does nothing."""


class State:
    """What bash's variables hold (a copy per branch that cannot be decided), the directory, the output of `$( )`."""

    def __init__(self, variables: dict[str, Value], cwd: str) -> None:
        self.vars = variables
        self.cwd = cwd
        self.funcs: dict[str, str] = {}
        self.status: int | Unknown = 0
        self.output: list[str] | None = None  # capturing for $( )
        self.output_unknown: Unknown | None = None

    def copy(self) -> "State":
        out = State({k: list(v) if isinstance(v, list) else v for k, v in self.vars.items()}, self.cwd)
        out.funcs, out.status = dict(self.funcs), self.status
        out.output = None if self.output is None else list(self.output)
        out.output_unknown = self.output_unknown
        return out


class Shell(Builtins):
    """Evaluates one script (and what it sources) for `environ` and `assume`."""

    def __init__(self, environ: dict[str, str], assume: Assumptions, on_command: Callable[..., None]) -> None:
        self.assume = assume
        self.state = State({**environ, **assume.names}, os.getcwd())
        self.on_command = on_command
        self.items: list[Item] = []
        self.unset_names: set[str] = set()
        self.sources: list[str] = []
        self.shadow: Unknown | None = None  # why the branch being evaluated may not run
        self.steps = 0
        self.undecided_loops = 0
        self.line = 0
        self.command_name = ""

    # running -----------------------------------------------------------------------------------------------
    def run_file(self, path: str) -> None:
        """Evaluate the script at `path`; `exit` ends it (ScriptExit), `Finished` is the caller's."""
        if len(self.sources) > 32:
            raise ConfigError(f"{path}: `source` nests more than 32 files deep")
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: cannot read the script: {getattr(e, 'strerror', None) or e}") from None
        self.sources.append(path)
        try:
            self.run_seq(syn.parse(text, path))
        finally:
            self.sources.pop()

    def item(self, what: str, unknown: Unknown | None = None) -> None:
        item = Item(self.here(), what, unknown)
        if all(i.message() != item.message() for i in self.items):
            self.items.append(item)

    def here(self) -> str:
        return f"{self.sources[-1] if self.sources else '?'}:{self.line}"

    @property
    def where(self) -> str:  # type: ignore[override]
        return self.sources[-1] if self.sources else "?"

    def run_seq(self, seq: syn.Seq) -> None:
        for command, background in seq.items:
            if background:  # `cmd &` runs in a subshell: its assignments never reach this shell
                self._in_copy(partial(self.run_and_or, command))
                self.state.status = 0
            else:
                self.run_and_or(command)

    def run_and_or(self, node: syn.AndOr) -> None:
        self.run_pipeline(node.first)
        for op, pipeline in node.rest:
            status = self.state.status
            if isinstance(status, Unknown):
                self._undecided(status, f"`{op}` list", [partial(self.run_pipeline, pipeline), _nothing])
            elif (status == 0) == (op == "&&"):
                self.run_pipeline(pipeline)

    def run_pipeline(self, node: syn.Pipeline) -> None:
        if len(node.commands) == 1:
            self.run_command(node.commands[0])
        else:  # each part runs in a subshell; the last one's output and status are the pipeline's
            capturing = self.state.output is not None
            for part in node.commands[:-1]:
                self._in_copy(partial(self.run_command, part), keep_output=False)
            saved = self.state
            self.state = saved.copy()
            self.state.output = [] if capturing else None
            try:
                self.run_command(node.commands[-1])
            finally:
                last, self.state = self.state, saved
            if capturing:
                self.emit("".join(last.output or []), last.output_unknown)
            self.state.status = last.status
        if node.negate:
            status = self.state.status
            self.state.status = status if isinstance(status, Unknown) else int(status == 0)

    def run_command(self, node) -> None:
        self.line = getattr(node, "line", self.line)
        try:
            self._dispatch(node)
        except Unknowable as e:  # a word of a command with no further effect: only its status is unknown
            self.state.status = e.unknown
        except ArithError as e:
            self.state.status = 1
            self.item(f"bash would report an error and the command fail: {e}")

    def _dispatch(self, node) -> None:
        if isinstance(node, syn.Simple):
            self.simple(node)
        elif isinstance(node, syn.If):
            self._if(node.clauses, node.orelse, 0)
        elif isinstance(node, syn.For):
            self._for(node)
        elif isinstance(node, syn.ArithFor):
            self._arith_for(node)
        elif isinstance(node, syn.While):
            self._while(node)
        elif isinstance(node, syn.Group):
            if node.subshell:
                self._in_copy(lambda: self.run_seq(node.body))
            else:
                self.run_seq(node.body)
        elif isinstance(node, syn.Arith):
            self.state.status = int(self.arith(self.one(node.expr, heredoc=True)) == 0)
        elif isinstance(node, syn.Cond):
            self.state.status = self.cond(node.words)
        elif isinstance(node, syn.FuncDef):
            self.state.funcs[node.name] = self.here()
            self.state.status = 0
        elif isinstance(node, syn.Case):
            self.item(
                "`case` is not evaluated by port-slime; rewrite it as if/elif or set what it decides with --assume"
            )
            self.state.status = Unknown(f"the `case` at {self.here()}, which port-slime does not evaluate")

    # control flow ------------------------------------------------------------------------------------------
    def _if(self, clauses: list[tuple[syn.Seq, syn.Seq]], orelse: syn.Seq | None, k: int) -> None:
        if k == len(clauses):
            if orelse is not None:
                self.run_seq(orelse)
            else:
                self.state.status = 0
            return
        cond, body = clauses[k]
        self.run_seq(cond)
        status = self.state.status
        if isinstance(status, Unknown):
            branches = [lambda: self.run_seq(body), lambda: self._if(clauses, orelse, k + 1)]
            self._undecided(status, "if", branches)
        elif status == 0:
            self.run_seq(body)
        else:
            self._if(clauses, orelse, k + 1)

    def _undecided(self, why: Unknown, construct: str, branches: list[Callable[[], None]]) -> None:
        """Run each branch on a copy of the state; a variable they leave different becomes Unknown."""
        where, base = self.here(), self.state
        outer, self.shadow = self.shadow, why
        ends: list[State] = []
        try:
            for branch in branches:
                self.state = base.copy()
                try:
                    branch()
                except EndBranch:
                    pass
                except LoopControl:  # break/continue under a condition that cannot be decided
                    if not self.undecided_loops:  # (in a loop that is undecided as a whole, it changes nothing)
                        self.item("`break` / `continue` depends on a condition port-slime cannot decide", why)
                ends.append(self.state)
        finally:
            self.shadow, self.state = outer, base
        for name in set().union(*(end.vars for end in ends)):
            values = [end.vars.get(name) for end in ends]
            if all(v == values[0] for v in values):
                value = values[0]
            elif name in self.assume.names:
                value = self.assume.names[name]
            else:
                value = Unknown(f"{why.why}; the {construct} at {where} sets {name} by it", why.settle).via(name)
            if value is None:
                base.vars.pop(name, None)
            else:
                base.vars[name] = value
        outputs = {"".join(end.output or []) for end in ends}
        if base.output is not None and (len(outputs) > 1 or any(end.output_unknown for end in ends)):
            base.output_unknown = why
        base.funcs.update({k: v for end in ends for k, v in end.funcs.items()})
        base.status = why

    def _in_copy(self, run: Callable[[], None], keep_output: bool = True) -> None:
        """A subshell: its assignments are lost, its output and status are kept."""
        saved = self.state
        self.state = saved.copy()
        if not keep_output:
            self.state.output = None
        try:
            run()
        except ScriptExit as e:
            self.state.status = int(e.code) if e.code.isdigit() else 1
        finally:
            sub, self.state = self.state, saved
        if keep_output and sub.output is not None and saved.output is not None:
            saved.output, saved.output_unknown = sub.output, sub.output_unknown
        saved.status = sub.status

    def _loop(self, next_value: Callable[[], bool], body: syn.Seq) -> None:
        while next_value():
            self.steps += 1
            if self.steps > _MAX_STEPS:
                raise ConfigError(f"{self.here()}: a loop runs more than {_MAX_STEPS} times; port-slime stops here")
            try:
                self.run_seq(body)
            except LoopControl as e:
                if e.levels > 1:
                    raise LoopControl(e.kind, e.levels - 1) from None
                if e.kind == "break":
                    break

    def _for(self, node: syn.For) -> None:
        try:
            words = [w for word in node.words or [] for w in self.fields(word.raw, strict=True)]
        except Unknowable as e:
            self._undecided_loop(e.unknown, node.body, node.var)
            return
        values = iter(words)

        def next_value() -> bool:
            value = next(values, None)
            if value is not None:
                self.state.vars[node.var] = value
            return value is not None

        self._loop(next_value, node.body)

    def _arith_for(self, node: syn.ArithFor) -> None:
        self.arith(self.one(node.init, heredoc=True))
        first = [True]

        def next_value() -> bool:
            if not first[0] and node.step:
                self.arith(self.one(node.step, heredoc=True))
            first[0] = False
            return not node.cond or self.arith(self.one(node.cond, heredoc=True)) != 0

        try:
            self._loop(next_value, node.body)
        except Unknowable as e:
            self._undecided_loop(e.unknown, node.body, None)

    def _while(self, node: syn.While) -> None:
        def next_value() -> bool:
            self.run_seq(node.cond)
            status = self.state.status
            if isinstance(status, Unknown):
                raise Unknowable(status)
            return (status == 0) != node.until

        try:
            self._loop(next_value, node.body)
        except Unknowable as e:
            self._undecided_loop(e.unknown, node.body, None)

    def _undecided_loop(self, why: Unknown, body: syn.Seq, var: str | None) -> None:
        def once() -> None:
            if var:
                self.state.vars[var] = why
            try:
                self.run_seq(body)
            except LoopControl:
                pass

        self.undecided_loops += 1
        try:
            self._undecided(why, "loop", [once, _nothing])
        finally:
            self.undecided_loops -= 1

    # simple commands ---------------------------------------------------------------------------------------
    def simple(self, node: syn.Simple) -> None:
        words = node.words
        k = 0
        while k < len(words) and _ASSIGNMENT.match(words[k].raw):
            k += 1
        if k == len(words):
            self.state.status = 0
            for word in words:
                self.assign_word(word.raw)
            self._redirect_output(node)
            return
        name = self.fields(words[k].raw)
        if not name:
            self.state.status = 0
            return
        if name[0] in _QUIET:
            self.state.status = 0
        elif name[0] in _DECLARE:
            self._declare(words[k + 1 :])
        elif name[0] in self.state.funcs:
            self.item(
                f"calls the function {name[0]} (defined at {self.state.funcs[name[0]]}); port-slime does "
                "not evaluate functions: set what it computes with --assume, or inline it"
            )
            self.state.status = Unknown(
                f"the function {name[0]} called at {self.here()}, which port-slime does not evaluate"
            )
        elif name[0] in BUILTINS:
            self.command_name = name[0]
            getattr(self, BUILTINS[name[0]])(words[k + 1 :], node)
        else:
            self._external(words[k:], node)

    def _external(self, words: list[syn.Word], node: syn.Simple) -> None:
        expanded: list = []
        for word in words:
            try:
                expanded += self.fields(word.raw)
            except Unknowable as e:
                expanded.append(UnknownWord(word.raw, e.unknown))
        self.on_command(expanded, self.here(), self.shadow)
        text = " ".join(w if isinstance(w, str) else "…" for w in expanded)[:80]
        self.state.status = Unknown(f"the exit status of `{text}` ({self.here()}), a command port-slime does not run")
        if self.state.output is not None and not self._stdout_redirected(node):
            self.emit("", Unknown(f"the output of `{text}` ({self.here()}), a command port-slime does not run"))

    def emit(self, text: str, unknown: Unknown | None = None) -> None:
        if self.state.output is None:
            return
        self.state.output.append(text)
        if unknown is not None and self.state.output_unknown is None:
            self.state.output_unknown = unknown

    def _stdout_redirected(self, node: syn.Simple) -> bool:
        for r in node.redirects:
            if r.op in ("&>", "&>>") or (r.op in (">", ">>", ">|", ">&") and r.fd in ("", "1")):
                return True
        return False

    def _redirect_output(self, node: syn.Simple) -> None:
        for r in node.redirects:  # `VAR=x > file` truncates a file, nothing to do with the variables
            if r.op in ("<<", "<<-") and r.body is not None and r.expand:
                self.one(r.body, heredoc=True)

    def assign_word(self, raw: str, export: bool = False) -> None:
        m = _ASSIGNMENT.match(raw)
        if m is None:
            raise self.fail(f"{raw!r} is not an assignment")
        name, index, plus, value_raw = m.group("name", "index", "plus", "value")
        if value_raw.startswith("(") and value_raw.endswith(")") and index is None:
            self._assign_array(name, value_raw[1:-1], bool(plus))
            return
        try:
            value = self.one(value_raw)
        except Unknowable as e:
            self.state.vars[name] = self.assume.names.get(name, e.unknown.via(name))
            return
        current = self.state.vars.get(name)
        if index is not None:
            items = current if isinstance(current, list) else ([] if current is None else [str(current)])
            slot = self.arith(self.one(index, heredoc=True)) if index not in ("@", "*") else len(items)
            if slot > len(items):  # bash arrays are sparse; a gap here would read as an empty element
                raise self.fail(f"{name}[{slot}]=...: sparse arrays (an index past the end) are not evaluated")
            items = list(items) + [""] * max(0, slot + 1 - len(items))
            items[slot] = (items[slot] + value) if plus else value
            self.state.vars[name] = items
        elif isinstance(current, list):
            self.state.vars[name] = [(current[0] if current else "") + value if plus else value] + current[1:]
        elif plus and isinstance(current, str):
            self.state.vars[name] = current + value
        elif plus and isinstance(current, Unknown):
            pass
        else:
            self.state.vars[name] = value

    def _assign_array(self, name: str, inner: str, append: bool) -> None:
        words = [t.text for t in syn.Lexer(inner, where=self.where, line0=self.line).run() if t.kind == "word"]
        try:
            values = [v for word in words for v in self.fields(word)]
        except Unknowable as e:  # an array is settled through what it is built from, not as one --assume
            self.state.vars[name] = e.unknown
            return
        current = self.state.vars.get(name)
        if append and isinstance(current, Unknown):
            return
        if append and isinstance(current, list):
            values = current + values
        elif append and isinstance(current, str):
            values = [current] + values
        self.state.vars[name] = values

    def _declare(self, args: list[syn.Word]) -> None:
        self.state.status = 0
        for word in args:
            if _ASSIGNMENT.match(word.raw):
                self.assign_word(word.raw)
            elif not word.raw.startswith("-") and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", word.raw):
                self.fields(word.raw)

    # variables (the Expander's hooks) ----------------------------------------------------------------------
    def value(self, name: str, index: str | None, strict: bool) -> str | list[str]:
        special = self._special(name, index)
        if special is not None:
            return special
        if name not in self.state.vars:
            if strict:
                raise Unknowable(
                    Unknown(f"{name} is set neither by the script nor in the environment", (f"{name}=VALUE",))
                )
            self.unset_names.add(name)
            return Joined() if index == "*" else [] if index == "@" else ""
        value = self.state.vars[name]
        if isinstance(value, Unknown):
            raise Unknowable(value)
        items = value if isinstance(value, list) else [value]
        if index in ("@", "*"):
            return Joined(items) if index == "*" else list(items)
        slot = 0 if index is None else self.arith(self.one(index, heredoc=True))
        return items[slot] if -len(items) <= slot < len(items) else ""

    def _special(self, name: str, index: str | None) -> str | list[str] | None:
        if name == "BASH_SOURCE":
            sources = list(reversed(self.sources))
            return sources if index in ("@", "*") else sources[int(index or 0)] if sources else ""
        if name in ("@", "*"):  # the script is converted as run without arguments
            return Joined() if name == "*" else []
        if name == "#":
            return "0"
        if name == "0":
            return self.sources[0] if self.sources else "bash"
        if name.isdigit():
            return ""
        if name == "PWD":
            return self.state.cwd
        if name == "?":
            if isinstance(self.state.status, Unknown):
                raise Unknowable(self.state.status)
            return str(self.state.status)
        if name in ("$", "!", "RANDOM", "SECONDS", "BASHPID"):
            raise Unknowable(Unknown(f"${name} ({self.here()}) differs from run to run"))
        return None

    def is_set(self, name: str, index: str | None) -> bool:
        if name in ("BASH_SOURCE", "PWD", "0", "#", "?"):
            return True
        value = self.state.vars.get(name)
        if value is None or index is None or index in ("@", "*"):
            return value is not None
        return isinstance(value, list) and len(value) > self.arith(self.one(index, heredoc=True))

    def assign(self, name: str, value: str) -> None:
        self.state.vars[name] = value

    def ifs(self) -> str:
        value = self.state.vars.get("IFS", " \t\n")
        return value if isinstance(value, str) else " \t\n"

    def home(self) -> str:
        value = self.state.vars.get("HOME")
        return value if isinstance(value, str) else os.path.expanduser("~")

    def arith(self, expr: str) -> int:
        def get(name: str) -> str:
            if name not in self.state.vars:
                return ""
            value = self.value(name, None, False)
            return value if isinstance(value, str) else ""

        return evaluate(expr, get, self.assign)

    def substitute(self, text: str) -> str:
        """`$( text )`: evaluated in a subshell, its output taken where every command in it is a known builtin."""
        saved, line = self.state, self.line
        self.state = saved.copy()
        self.state.output, self.state.output_unknown = [], None
        try:
            self.run_seq(syn.parse(text, self.where, line0=self.line))
        except ScriptExit:
            pass
        finally:
            sub, self.state, self.line = self.state, saved, line
        if sub.output_unknown is not None:
            short = " ".join(text.split())
            short = short if len(short) <= 70 else short[:67] + "..."
            raise Unknowable(Unknown(f"the output of `{short}` ({self.here()}), which port-slime does not run"))
        return "".join(sub.output or []).rstrip("\n")
