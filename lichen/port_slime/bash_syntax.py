"""Bash syntax for port-slime's static evaluator (lichen.port_slime.bash_eval): text -> tokens -> a small tree.

Only the parse: words are kept raw (quotes and `$...` intact) because expansion needs to know what was quoted.
The lexer knows quotes, `\\` escapes, line continuations, comments, `$( )` / `$(( ))` / `${ }` / backquotes inside
words, `NAME=( ... )` array literals (over several lines, with comments), here-documents and redirections. The
parser builds simple commands, pipelines, `&&` / `||` lists, `if/elif/else`, `for` (both forms), `while` /
`until`, `{ }`, `( )`, `(( ))`, `[[ ]]`, function definitions and `case` (kept as text: not evaluated).
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

from lichen.errors import ConfigError

_ARRAY_START = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\[[^]]*\])?\+?=$")
_OPERATORS = ("&&", "||", ";;", "|&", ";", "&", "|", "(", ")")
_REDIRECTS = ("<<<", "<<-", "&>>", "<<", ">>", "<&", ">&", "&>", ">|", "<", ">")
_BEFORE_COMMAND = {"for", "if", "then", "elif", "else", "do", "while", "until", "!", "{"}


@dataclass
class Word:
    raw: str
    line: int


@dataclass
class Redirect:
    op: str
    fd: str  # "" when not given
    target: str  # raw word (the delimiter of a here-document)
    body: str | None = None  # a here-document's text
    expand: bool = True  # False for a quoted here-document delimiter


@dataclass
class Simple:
    words: list[Word]
    redirects: list[Redirect]
    line: int


@dataclass
class Pipeline:
    commands: list
    negate: bool
    line: int


@dataclass
class AndOr:
    first: Pipeline
    rest: list[tuple[str, Pipeline]]
    line: int


@dataclass
class Seq:
    items: list[tuple[AndOr, bool]]  # (command, run in the background)


@dataclass
class If:
    clauses: list[tuple[Seq, Seq]]  # (condition, body) of the if and each elif
    orelse: Seq | None
    line: int


@dataclass
class For:
    var: str
    words: list[Word] | None  # None: `for NAME; do` (the positional parameters)
    body: Seq
    line: int


@dataclass
class ArithFor:
    init: str
    cond: str
    step: str
    body: Seq
    line: int


@dataclass
class While:
    cond: Seq
    body: Seq
    until: bool
    line: int


@dataclass
class Group:
    body: Seq
    subshell: bool
    line: int


@dataclass
class Arith:
    expr: str
    line: int


@dataclass
class Cond:
    """`[[ ... ]]`: its words, with the operators `&&` `||` `(` `)` `!` as plain strings."""

    words: list[Word | str]
    line: int


@dataclass
class FuncDef:
    name: str
    body: object
    line: int


@dataclass
class Case:
    text: str
    line: int


@dataclass
class Token:
    kind: str  # word, op, redir, arith, newline
    text: str
    line: int
    redirect: Redirect | None = None
    glued: bool = False  # an op written right after the previous token, e.g. `name()`


@dataclass
class _Pending:
    redirect: Redirect
    strip_tabs: bool


class Lexer:
    """Tokens of `text` from `pos`; with `paren` it stops at the `)` that closes a `$(` (the end is `self.pos`)."""

    def __init__(self, text: str, pos: int = 0, *, paren: bool = False, where: str = "", line0: int = 1) -> None:
        self.text, self.pos, self.paren, self.where = text, pos, paren, where
        self.starts = [0] + [m.end() for m in re.finditer("\n", text)]
        self.line0 = line0
        self.tokens: list[Token] = []
        self.pending: list[_Pending] = []

    def line(self, pos: int) -> int:
        return self.line0 + bisect.bisect_right(self.starts, pos) - 1

    def fail(self, what: str, pos: int) -> ConfigError:
        return ConfigError(f"{self.where}:{self.line(pos)}: {what}")

    def run(self) -> list[Token]:
        text, depth = self.text, 0
        while self.pos < len(text):
            c, start = text[self.pos], self.pos
            if c in " \t":
                self.pos += 1
            elif text.startswith("\\\n", self.pos):
                self.pos += 2
            elif c == "#":
                while self.pos < len(text) and text[self.pos] != "\n":
                    self.pos += 1
            elif c == "\n":
                self.pos += 1
                self.tokens.append(Token("newline", "\n", self.line(start)))
                self._heredocs()
            elif text.startswith("((", self.pos) and self._command_position():
                end = _arith_end(text, self.pos + 2)
                if end < 0:
                    raise self.fail("`((` without its `))`", start)
                self.tokens.append(Token("arith", text[self.pos + 2 : end], self.line(start)))
                self.pos = end + 2
            elif c == ")" and self.paren and depth == 0:
                return self.tokens
            elif any(text.startswith(r, self.pos) for r in _REDIRECTS):
                self._redirect("")
            elif any(text.startswith(op, self.pos) for op in _OPERATORS):
                op = next(op for op in _OPERATORS if text.startswith(op, self.pos))
                depth += {"(": 1, ")": -1}.get(op, 0)
                glued = start > 0 and text[start - 1] not in " \t\n"
                self.tokens.append(Token("op", op, self.line(start), glued=glued))
                self.pos += len(op)
            else:
                word = self._word()
                if word.isdigit() and self.pos < len(text) and text[self.pos] in "<>":
                    self._redirect(word)
                else:
                    glued = start > 0 and text[start - 1] not in " \t\n"
                    self.tokens.append(Token("word", word, self.line(start), glued=glued))
        if self.paren:
            raise self.fail("`$(` without its `)`", len(text) - 1)
        if self.pending:
            raise self.fail(f"here-document `{self.pending[0].redirect.target}` has no end line", len(text) - 1)
        return self.tokens

    def _command_position(self) -> bool:
        last = self.tokens[-1] if self.tokens else None
        if last is None or last.kind == "newline" or (last.kind == "word" and last.text in _BEFORE_COMMAND):
            return True
        return last.kind == "op" and last.text != ")"

    def _redirect(self, fd: str) -> None:
        op = next(r for r in _REDIRECTS if self.text.startswith(r, self.pos))
        line = self.line(self.pos)
        self.pos += len(op)
        while self.pos < len(self.text) and self.text[self.pos] in " \t":
            self.pos += 1
        target = self._word()
        if not target:
            raise self.fail(f"`{op}` without a target", self.pos)
        redirect = Redirect(op, fd, target)
        if op in ("<<", "<<-"):
            redirect.expand = not any(q in target for q in "'\"\\")
            redirect.target = re.sub(r"[\"'\\]", "", target)
            self.pending.append(_Pending(redirect, op == "<<-"))
        self.tokens.append(Token("redir", op, line, redirect))

    def _heredocs(self) -> None:
        for pending in self.pending:
            lines: list[str] = []
            while True:
                if self.pos >= len(self.text):
                    raise self.fail(f"here-document `{pending.redirect.target}` has no end line", self.pos - 1)
                end = self.text.find("\n", self.pos)
                end = len(self.text) if end < 0 else end
                line = self.text[self.pos : end]
                self.pos = min(end + 1, len(self.text))
                if pending.strip_tabs:
                    line = line.lstrip("\t")
                if line == pending.redirect.target:
                    break
                lines.append(line + "\n")
            pending.redirect.body = "".join(lines)
        self.pending = []

    def _word(self) -> str:
        """One word, raw; its end is where unquoted blank space or an operator starts."""
        text, start = self.text, self.pos
        while self.pos < len(text):
            c = text[self.pos]
            if c in " \t\n;&|<>)":
                break
            if c == "(":
                if not _ARRAY_START.match(text[start : self.pos]):
                    break
                self.pos = self._sub(self.pos + 1) + 1  # NAME=( ... ): the list, lexed to find its end
            elif c == "\\":
                self.pos += 2
            elif c == "'":
                end = text.find("'", self.pos + 1)
                if end < 0:
                    raise self.fail("unmatched single quote", self.pos)
                self.pos = end + 1
            elif c == '"':
                self.pos = self._dquote(self.pos + 1) + 1
            elif c == "$" or c == "`":
                self.pos = self._dollar(self.pos)
            else:
                self.pos += 1
        return text[start : self.pos].replace("\\\n", "")

    def _dquote(self, pos: int) -> int:
        """Position of the `"` that closes a double-quoted string starting at pos."""
        text = self.text
        while pos < len(text):
            c = text[pos]
            if c == '"':
                return pos
            if c == "\\":
                pos += 2
            elif c in "$`":
                pos = self._dollar(pos)
            else:
                pos += 1
        raise self.fail("unmatched double quote", pos - 1)

    def _dollar(self, pos: int) -> int:
        """The end of a `$...` / backquote construct at pos (pos itself when it is a plain `$`)."""
        text = self.text
        if text[pos] == "`":
            end = pos + 1
            while end < len(text) and text[end] != "`":
                end += 2 if text[end] == "\\" else 1
            if end >= len(text):
                raise self.fail("unmatched backquote", pos)
            return end + 1
        if text.startswith("$((", pos):
            end = _arith_end(text, pos + 3)
            if end >= 0:
                return end + 2
        if text.startswith("$(", pos):
            return self._sub(pos + 2) + 1
        if text.startswith("${", pos):
            depth, i = 1, pos + 2
            while i < len(text) and depth:
                c = text[i]
                if c == "\\":
                    i += 1
                elif c == "'" and depth:
                    i = text.find("'", i + 1)
                    if i < 0:
                        break
                elif c == '"':
                    i = self._dquote(i + 1)
                elif c == "$" and text[i + 1 : i + 2] in ("{", "("):
                    i = self._dollar(i) - 1
                elif c == "}":
                    depth -= 1
                i += 1
            if depth:
                raise self.fail("`${` without its `}`", pos)
            return i
        return pos + 1

    def _sub(self, pos: int) -> int:
        """Position of the `)` closing a `$(` or an array list whose text starts at pos."""
        sub = Lexer(self.text, pos, paren=True, where=self.where, line0=self.line0)
        sub.starts = self.starts
        sub.run()
        return sub.pos


def _arith_end(text: str, pos: int) -> int:
    """Position of the `))` closing an arithmetic expression starting at pos, -1 when there is none."""
    depth = 0
    while pos < len(text):
        c = text[pos]
        if c == "(":
            depth += 1
        elif c == ")":
            if depth == 0:
                return pos if text.startswith("))", pos) else -1
            depth -= 1
        pos += 1
    return -1


class Parser:
    """Tokens -> a Seq. Reserved words count only where a command starts, as in bash."""

    def __init__(self, tokens: list[Token], where: str) -> None:
        self.tokens, self.i, self.where = tokens, 0, where

    def fail(self, what: str) -> ConfigError:
        token = self.peek()
        line = token.line if token else (self.tokens[-1].line if self.tokens else 1)
        return ConfigError(f"{self.where}:{line}: {what}")

    def peek(self, k: int = 0) -> Token | None:
        return self.tokens[self.i + k] if self.i + k < len(self.tokens) else None

    def at_word(self, *texts: str) -> bool:
        token = self.peek()
        return token is not None and token.kind == "word" and token.text in texts

    def at_op(self, *texts: str) -> bool:
        token = self.peek()
        return token is not None and token.kind == "op" and token.text in texts

    def take(self) -> Token:
        token = self.peek()
        if token is None:
            raise self.fail("unexpected end of the script")
        self.i += 1
        return token

    def expect_word(self, text: str) -> None:
        if not self.at_word(text):
            found = self.peek()
            raise self.fail(f"expected `{text}`, found {repr(found.text) if found else 'the end'}")
        self.i += 1

    def skip_newlines(self) -> None:
        while self.peek() is not None and self.peek().kind == "newline":  # type: ignore[union-attr]
            self.i += 1

    def parse(self) -> Seq:
        seq = self.seq(())
        if self.peek() is not None:
            raise self.fail(f"unexpected {self.peek().text!r}")  # type: ignore[union-attr]
        return seq

    def seq(self, stop: tuple[str, ...]) -> Seq:
        items: list[tuple[AndOr, bool]] = []
        while True:
            self.skip_newlines()
            token = self.peek()
            if token is None or (token.kind == "word" and token.text in stop) or self.at_op(")", ";;"):
                return Seq(items)
            command = self.and_or()
            background = self.at_op("&")
            if self.at_op(";", "&"):
                self.i += 1
            items.append((command, background))

    def and_or(self) -> AndOr:
        first = self.pipeline()
        rest: list[tuple[str, Pipeline]] = []
        while self.at_op("&&", "||"):
            op = self.take().text
            self.skip_newlines()
            rest.append((op, self.pipeline()))
        return AndOr(first, rest, first.line)

    def pipeline(self) -> Pipeline:
        line = self.peek().line if self.peek() else 0  # type: ignore[union-attr]
        negate = self.at_word("!")
        if negate:
            self.i += 1
        commands = [self.command()]
        while self.at_op("|", "|&"):
            self.i += 1
            self.skip_newlines()
            commands.append(self.command())
        return Pipeline(commands, negate, line)

    def command(self):
        token = self.peek()
        if token is None:
            raise self.fail("a command is missing")
        line = token.line
        if token.kind == "arith":
            self.i += 1
            return Arith(token.text, line)
        if self.at_op("("):
            self.i += 1
            body = self.seq(())
            if not self.at_op(")"):
                raise self.fail("`(` without its `)`")
            self.i += 1
            return Group(body, True, line)
        if token.kind == "word":
            keyword = {"if": self.if_, "for": self.for_, "while": self.while_, "until": self.while_}.get(token.text)
            if keyword:
                return keyword()
            if token.text == "{":
                self.i += 1
                body = self.seq(("}",))
                self.expect_word("}")
                return Group(body, False, line)
            if token.text == "case":
                return self.case()
            if token.text == "[[":
                return self.cond()
            if token.text == "function":
                self.i += 1
                name = self.take().text
                after = self.peek(1)
                if self.at_op("(") and after is not None and after.text == ")":
                    self.i += 2
                self.skip_newlines()
                return FuncDef(name, self.command(), line)
            nxt, after = self.peek(1), self.peek(2)
            if nxt and nxt.kind == "op" and nxt.text == "(" and after and after.kind == "op" and after.text == ")":
                self.i += 3
                self.skip_newlines()
                return FuncDef(token.text, self.command(), line)
        return self.simple()

    def simple(self) -> Simple:
        line = self.peek().line  # type: ignore[union-attr]
        words: list[Word] = []
        redirects: list[Redirect] = []
        while (token := self.peek()) is not None and token.kind in ("word", "redir"):
            self.i += 1
            if token.kind == "redir":
                redirects.append(token.redirect)  # type: ignore[arg-type]
            else:
                words.append(Word(token.text, token.line))
        if not words and not redirects:
            raise self.fail(f"unexpected {self.peek().text!r}" if self.peek() else "a command is missing")  # type: ignore[union-attr]
        return Simple(words, redirects, line)

    def if_(self) -> If:
        line = self.take().line
        clauses: list[tuple[Seq, Seq]] = []
        orelse = None
        while True:
            cond = self.seq(("then",))
            self.expect_word("then")
            clauses.append((cond, self.seq(("elif", "else", "fi"))))
            if self.at_word("elif"):
                self.i += 1
                continue
            if self.at_word("else"):
                self.i += 1
                orelse = self.seq(("fi",))
            self.expect_word("fi")
            return If(clauses, orelse, line)

    def for_(self):
        line = self.take().line
        token = self.peek()
        if token is not None and token.kind == "arith":
            self.i += 1
            parts = token.text.split(";")
            if len(parts) != 3:
                raise self.fail("`for ((...))` needs three parts separated by `;`")
            self._before_do()
            return ArithFor(*[p.strip() for p in parts], body=self._do_body(), line=line)
        var = self.take().text
        words: list[Word] | None = None
        self.skip_newlines()
        if self.at_word("in"):
            self.i += 1
            words = []
            while (token := self.peek()) is not None and token.kind == "word":
                self.i += 1
                words.append(Word(token.text, token.line))
        self._before_do()
        return For(var, words, self._do_body(), line)

    def while_(self) -> While:
        token = self.take()
        cond = self.seq(("do",))
        return While(cond, self._do_body(), token.text == "until", token.line)

    def _before_do(self) -> None:
        if self.at_op(";"):
            self.i += 1
        self.skip_newlines()

    def _do_body(self) -> Seq:
        self.expect_word("do")
        body = self.seq(("done",))
        self.expect_word("done")
        return body

    def case(self) -> Case:
        token = self.take()
        parts = [token.text]
        while not self.at_word("esac"):
            parts.append(self.take().text)
        self.i += 1
        return Case(" ".join(p for p in parts if p != "\n"), token.line)

    def cond(self) -> Cond:
        line = self.take().line
        words: list[Word | str] = []
        while not self.at_word("]]"):
            token = self.take()
            if words and isinstance(words[-1], Word) and words[-1].raw == "=~":
                words.append(Word(self._regex(token), token.line))
            elif token.kind == "word":
                words.append(Word(token.text, token.line))
            elif token.kind == "op" and token.text in ("&&", "||", "(", ")"):
                words.append(token.text)
            elif token.kind == "redir":
                raise self.fail(f"`{token.text}` inside [[ ]] (string ordering) is not evaluated")
        self.i += 1
        return Cond(words, line)

    def _regex(self, first: Token) -> str:
        """The right side of `=~`: its parentheses and `|` belong to the regex, up to unquoted blank space."""
        text = first.text
        while (token := self.peek()) is not None and token.glued and not self.at_word("]]"):
            text += token.text
            self.i += 1
        return text


def parse(text: str, where: str, line0: int = 1) -> Seq:
    """The command tree of bash `text`; a syntax error is a ConfigError naming `where` and the line."""
    return Parser(Lexer(text, where=where, line0=line0).run(), where).parse()
