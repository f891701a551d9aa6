"""Word expansion as bash does it, for port-slime's static evaluator: quotes, `$NAME`, `${...}` (defaults,
assignment, alternatives, lengths, `#`/`%` trimming, substrings, arrays with `[@]` / `[*]`), `$(( ))`, `$( )`,
tilde, then word splitting on IFS of the unquoted expansions, and dropping of empty unquoted words.

A piece of a word is (text, kind): "lit" (literal text of the script), "q" (quoted) or "x" (an unquoted expansion,
the only kind that is split). `Expander` leaves variable lookup, command substitution and arithmetic to the
evaluator (lichen.port_slime.bash_eval), which subclasses it.
"""

from __future__ import annotations

import fnmatch
import os
import re

from lichen.errors import ConfigError
from lichen.port_slime.bash_syntax import Lexer
from lichen.port_slime.bash_values import Unknowable, Unknown

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]|[@*#?$!]")
_PARAM = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*|[0-9]+|[@*#?$!])(?:\[(?P<index>[^]]*)\])?(?P<rest>.*)$", re.S)
_DEFAULT_IFS = " \t\n"
Field = list[tuple[str, str]]


class Joined(list):
    """The elements of `${ARR[*]}` / `$*`: one word joined by IFS's first character when double-quoted."""


class Expander:
    """Expansion of raw words; subclasses give `value`, `is_set`, `assign`, `substitute`, `arith`, `unset_var`."""

    where = ""
    line = 0

    # evaluator hooks ---------------------------------------------------------------------------------------
    def value(self, name: str, index: str | None, strict: bool) -> str | list[str]:
        raise NotImplementedError

    def is_set(self, name: str, index: str | None) -> bool:
        raise NotImplementedError

    def assign(self, name: str, value: str) -> None:
        raise NotImplementedError

    def substitute(self, text: str) -> str:
        raise NotImplementedError

    def arith(self, expr: str) -> int:
        raise NotImplementedError

    def ifs(self) -> str:
        raise NotImplementedError

    def home(self) -> str:
        return os.path.expanduser("~")

    # public ------------------------------------------------------------------------------------------------
    def fields(self, raw: str, strict: bool = False) -> list[str]:
        """The words `raw` expands to (split, empty unquoted ones dropped)."""
        fields, _ = self._parts(raw, False, False, strict)
        out: list[str] = []
        for field in fields:
            out += self._split(field)
        return out

    def one(self, raw: str, strict: bool = False, heredoc: bool = False) -> str:
        """`raw` expanded without splitting (an assignment's value, a `[[ ]]` operand, a here-document)."""
        fields, _ = self._parts(raw, heredoc, heredoc, strict)
        return " ".join("".join(text for text, _ in field) for field in fields)

    def fail(self, what: str) -> ConfigError:
        return ConfigError(f"{self.where}:{self.line}: {what}")

    # internals ---------------------------------------------------------------------------------------------
    def _parts(self, raw: str, in_dq: bool, heredoc: bool, strict: bool) -> tuple[list[Field], bool]:
        """Fields of pieces; the flag says whether an array's `[@]` was expanded (an empty one leaves no word)."""
        fields: list[Field] = [[]]
        had_array = False
        lexer = Lexer(raw, where=self.where, line0=self.line)
        kind = "q" if in_dq else "x"
        i = 0
        while i < len(raw):
            c = raw[i]
            if c == "'" and not in_dq:
                end = raw.find("'", i + 1)
                fields[-1].append((raw[i + 1 : end], "q"))
                i = end + 1
            elif c == '"' and not heredoc:
                end = lexer._dquote(i + 1)
                inner, array = self._parts(raw[i + 1 : end], True, False, strict)
                fields[-1] += inner[0]
                fields += inner[1:]
                if not any(inner) and not array:
                    fields[-1].append(("", "q"))
                had_array |= array
                i = end + 1
            elif c == "\\" and i + 1 < len(raw):
                nxt = raw[i + 1]
                special = "$`\\\n" if heredoc else '$`"\\\n'
                fields[-1].append((nxt if not in_dq or nxt in special else c + nxt, "q" if not in_dq else kind))
                i += 2
            elif c == "`" or (c == "$" and raw[i + 1 : i + 2] in ("(", "{")):
                end = lexer._dollar(i)
                values = self._dollar(raw[i:end], strict)
                if isinstance(values, list):
                    had_array = True
                    self._add_array(fields, values, in_dq)
                else:
                    fields[-1].append((values, kind))
                i = end
            elif c == "$" and (m := _NAME.match(raw, i + 1)):
                values = self._param(m.group(0), None, "", strict)
                if isinstance(values, list):
                    had_array = True
                    self._add_array(fields, values, in_dq)
                else:
                    fields[-1].append((values, kind))
                i = m.end()
            elif c == "~" and i == 0 and not in_dq and (len(raw) == 1 or raw[1] == "/"):
                fields[-1].append((self.home(), "lit"))
                i += 1
            else:
                fields[-1].append((c, "q" if in_dq else "lit"))
                i += 1
        return fields, had_array

    def _add_array(self, fields: list[Field], values: list[str], in_dq: bool) -> None:
        if in_dq and isinstance(values, Joined):
            fields[-1].append((self.ifs()[:1].join(values), "q"))
            return
        if not in_dq:
            fields[-1].append((" ".join(values), "x"))
            return
        for k, value in enumerate(values):
            if k:
                fields.append([])
            fields[-1].append((value, "q"))

    def _split(self, field: Field) -> list[str]:
        """Word splitting of one field: unquoted expansions split on IFS; an all-empty unquoted field is dropped."""
        ifs = self.ifs()
        out: list[str] = []
        cur, keep = "", False
        for text, kind in field:
            if kind != "x" or not ifs:
                cur += text
                keep = True
                continue
            parts = re.split(f"[{re.escape(ifs)}]+", text)
            for k, part in enumerate(parts):
                if k and (keep or cur):
                    out.append(cur)
                    cur, keep = "", False
                cur += part
                keep = keep or bool(part)
        if keep or cur:
            out.append(cur)
        return out

    def _dollar(self, text: str, strict: bool) -> str | list[str]:
        if text.startswith("$((") and text.endswith("))"):
            return str(self.arith(self.one(text[3:-2], strict, heredoc=True)))
        if text.startswith("$("):
            return self.substitute(text[2:-1])
        if text.startswith("`"):
            return self.substitute(re.sub(r"\\([$`\\])", r"\1", text[1:-1]))
        return self._braced(text[2:-1], strict)

    def _braced(self, body: str, strict: bool) -> str | list[str]:
        if body.startswith("#") and len(body) > 1:
            m = _PARAM.match(body[1:])
            if not m or m.group("rest"):
                raise Unknowable(
                    Unknown(f"`${{{body}}}` ({self.where}:{self.line}) is a form port-slime does not evaluate")
                )
            return str(len(self.value(m.group("name"), m.group("index"), strict)))
        m = _PARAM.match(body)
        if not m:
            raise Unknowable(
                Unknown(f"`${{{body}}}` ({self.where}:{self.line}) is a form port-slime does not evaluate")
            )
        return self._param(m.group("name"), m.group("index"), m.group("rest"), strict)

    def _param(self, name: str, index: str | None, rest: str, strict: bool) -> str | list[str]:
        op = re.match(r":?[-=+?]|##?|%%?|:", rest)
        if not rest:
            return self.value(name, index, strict)
        if op is None:
            raise Unknowable(
                Unknown(f"`${{{name}{rest}}}` ({self.where}:{self.line}) is a form port-slime does not evaluate")
            )
        op_text, word = op.group(0), rest[op.end() :]
        if op_text == ":" and word[:1] not in "-=+?":
            return self._substring(name, index, word, strict)
        if op_text in ("#", "##", "%", "%%"):
            value = self.value(name, index, strict)
            pattern = self.one(word, strict)
            if isinstance(value, list):
                return [_trim(v, pattern, op_text) for v in value]
            return _trim(value, pattern, op_text)
        is_set = self.is_set(name, index)
        if is_set and op_text.startswith(":"):
            current = self.value(name, index, False)
            is_set = bool(current if isinstance(current, str) else current)
        if op_text in (":-", "-"):
            return self.value(name, index, False) if is_set else self.one(word, strict)
        if op_text in (":=", "="):
            if not is_set:
                self.assign(name, self.one(word, strict))
            return self.value(name, index, False)
        if op_text in (":+", "+"):
            return self.one(word, strict) if is_set else ""
        if not is_set:  # :? and ?: bash prints the message and the (non-interactive) shell exits
            raise self.fail(f"${{{name}{rest}}}: {name} is not set, so bash stops the script here")
        return self.value(name, index, False)

    def _substring(self, name: str, index: str | None, spec: str, strict: bool) -> str | list[str]:
        offset_text, _, length_text = spec.partition(":")
        value = self.value(name, index, strict)
        offset = self.arith(self.one(offset_text, strict))
        seq = value if isinstance(value, list) else value
        start = offset if offset >= 0 else max(0, len(seq) + offset)
        if length_text:
            length = self.arith(self.one(length_text, strict))
            end = start + length if length >= 0 else len(seq) + length
            return seq[start:end]
        return seq[start:]


def _trim(value: str, pattern: str, op: str) -> str:
    """`${v#p}` / `${v##p}` (shortest / longest prefix matching glob p) and `%` / `%%` (suffix)."""
    sizes = range(len(value) + 1) if op in ("#", "%") else range(len(value), -1, -1)
    for size in sizes:
        if op.startswith("#") and fnmatch.fnmatchcase(value[:size], pattern):
            return value[size:]
        if op.startswith("%") and fnmatch.fnmatchcase(value[len(value) - size :], pattern):
            return value[: len(value) - size]
    return value
