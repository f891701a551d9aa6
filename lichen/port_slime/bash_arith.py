"""Bash integer arithmetic (`$(( ))`, `(( ))`, `let`, `for ((;;))`) for port-slime's static evaluator.

Parsed to a small tree, then evaluated, so `&&`, `||` and `?:` skip the side effects of the branch not taken, as
bash does. Integers are 64-bit in bash; Python's are unbounded, which only differs on overflow. Division and `%`
truncate toward zero (C), unlike Python's floor division.
"""

from __future__ import annotations

import re
from typing import Callable

from lichen.errors import ConfigError

_TOKEN = re.compile(
    r"\s*(?:(?P<num>\d+#[0-9A-Za-z@_]+|0[xX][0-9a-fA-F]+|\d+)|(?P<name>[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<op><<=|>>=|\*\*|\+\+|--|<<|>>|<=|>=|==|!=|&&|\|\||[-+*/%&|^]=|[-+*/%<>&|^!~?:,=()]))"
)
_BINARY = [  # lowest first
    ("||",),
    ("&&",),
    ("|",),
    ("^",),
    ("&",),
    ("==", "!="),
    ("<", ">", "<=", ">="),
    ("<<", ">>"),
    ("+", "-"),
    ("*", "/", "%"),
]
_ASSIGN = ("=", "+=", "-=", "*=", "/=", "%=", "<<=", ">>=", "&=", "|=", "^=")


class ArithError(ConfigError):
    """An expression bash would reject (bash prints an error and the command fails)."""


def evaluate(expr: str, get: Callable[[str], str], set_: Callable[[str, str], None]) -> int:
    """The value of `expr`; `get(name)` reads a variable (its text), `set_(name, text)` assigns one."""
    tokens = _tokens(expr)
    if not tokens:
        return 0
    parser = _Parser(tokens, expr)
    tree = parser.comma()
    if parser.i != len(tokens):
        raise ArithError(f"$(( {expr} )): unexpected {tokens[parser.i]!r}")
    return _Eval(get, set_, expr).run(tree)


def _tokens(expr: str) -> list[str]:
    out: list[str] = []
    pos = 0
    while pos < len(expr):
        if expr[pos:].strip() == "":
            break
        m = _TOKEN.match(expr, pos)
        if not m:
            raise ArithError(f"$(( {expr} )): cannot read {expr[pos:].strip()!r}")
        out.append(m.group("num") or m.group("name") or m.group("op"))
        pos = m.end()
    return out


class _Parser:
    def __init__(self, tokens: list[str], expr: str) -> None:
        self.tokens, self.i, self.expr = tokens, 0, expr

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise ArithError(f"$(( {self.expr} )): the expression ends too early")
        self.i += 1
        return token

    def comma(self) -> tuple:
        node = self.assign()
        while self.peek() == ",":
            self.i += 1
            node = (",", node, self.assign())
        return node

    def assign(self) -> tuple:
        if self.i + 1 < len(self.tokens) and _is_name(self.tokens[self.i]) and self.tokens[self.i + 1] in _ASSIGN:
            name, op = self.tokens[self.i], self.tokens[self.i + 1]
            self.i += 2
            return ("assign", op, name, self.assign())
        return self.ternary()

    def ternary(self) -> tuple:
        cond = self.binary(0)
        if self.peek() != "?":
            return cond
        self.i += 1
        yes = self.assign()
        if self.take() != ":":
            raise ArithError(f"$(( {self.expr} )): `?` without `:`")
        return ("?", cond, yes, self.assign())

    def binary(self, level: int) -> tuple:
        if level == len(_BINARY):
            return self.power()
        node = self.binary(level + 1)
        while self.peek() in _BINARY[level]:
            op = self.take()
            node = (op, node, self.binary(level + 1))
        return node

    def power(self) -> tuple:
        base = self.unary()
        if self.peek() == "**":
            self.i += 1
            return ("**", base, self.power())
        return base

    def unary(self) -> tuple:
        token = self.peek()
        if token in ("!", "~", "-", "+"):
            self.i += 1
            return ("unary", token, self.unary())
        if token in ("++", "--"):
            self.i += 1
            name = self.take()
            if not _is_name(name):
                raise ArithError(f"$(( {self.expr} )): {token} needs a variable")
            return ("pre", token, name)
        return self.postfix()

    def postfix(self) -> tuple:
        token = self.take()
        if token == "(":
            node = self.comma()
            if self.take() != ")":
                raise ArithError(f"$(( {self.expr} )): `(` without `)`")
            return node
        if _is_name(token):
            if self.peek() in ("++", "--"):
                return ("post", self.take(), token)
            return ("var", token)
        if token[0].isdigit():
            return ("num", _number(token, self.expr))
        raise ArithError(f"$(( {self.expr} )): unexpected {token!r}")


def _is_name(token: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", token))


def _number(token: str, expr: str) -> int:
    try:
        if "#" in token:
            base, digits = token.split("#", 1)
            return int(digits, int(base))
        if token.lower().startswith("0x"):
            return int(token, 16)
        if len(token) > 1 and token.startswith("0"):
            return int(token, 8)
        return int(token)
    except ValueError:
        raise ArithError(f"$(( {expr} )): {token!r} is not a number") from None


def _c_div(a: int, b: int) -> int:
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


_OPS: dict[str, Callable[[int, int], int]] = {
    "|": lambda a, b: a | b,
    "^": lambda a, b: a ^ b,
    "&": lambda a, b: a & b,
    "==": lambda a, b: int(a == b),
    "!=": lambda a, b: int(a != b),
    "<": lambda a, b: int(a < b),
    ">": lambda a, b: int(a > b),
    "<=": lambda a, b: int(a <= b),
    ">=": lambda a, b: int(a >= b),
    "<<": lambda a, b: a << b,
    ">>": lambda a, b: a >> b,
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": _c_div,
    "%": lambda a, b: a - _c_div(a, b) * b,
    "**": lambda a, b: a**b,
}


class _Eval:
    def __init__(self, get: Callable[[str], str], set_: Callable[[str, str], None], expr: str) -> None:
        self.get, self.set, self.expr, self.depth = get, set_, expr, 0

    def var(self, name: str) -> int:
        """A variable's text is itself an expression (empty: 0), as in bash."""
        text = self.get(name).strip()
        if re.fullmatch(r"-?\d+", text):
            return int(text)
        if not text:
            return 0
        self.depth += 1
        if self.depth > 64:
            raise ArithError(f"$(( {self.expr} )): {name} refers to itself")
        try:
            return evaluate(text, self.get, self.set)
        finally:
            self.depth -= 1

    def run(self, node: tuple) -> int:
        kind = node[0]
        if kind == "num":
            return node[1]
        if kind == "var":
            return self.var(node[1])
        if kind == ",":
            self.run(node[1])
            return self.run(node[2])
        if kind == "?":
            return self.run(node[2]) if self.run(node[1]) else self.run(node[3])
        if kind == "&&":
            return int(bool(self.run(node[1])) and bool(self.run(node[2])))
        if kind == "||":
            return int(bool(self.run(node[1])) or bool(self.run(node[2])))
        if kind == "unary":
            value = self.run(node[2])
            return {"!": int(not value), "~": ~value, "-": -value, "+": value}[node[1]]
        if kind in ("pre", "post"):
            old = self.var(node[2])
            new = old + (1 if node[1] == "++" else -1)
            self.set(node[2], str(new))
            return new if kind == "pre" else old
        if kind == "assign":
            _, op, name, rhs = node
            value = self.run(rhs)
            if op != "=":
                value = self._binary(op[:-1], self.var(name), value)
            self.set(name, str(value))
            return value
        return self._binary(kind, self.run(node[1]), self.run(node[2]))

    def _binary(self, op: str, a: int, b: int) -> int:
        if op in ("/", "%") and b == 0:
            raise ArithError(f"$(( {self.expr} )): division by 0")
        if op == "**" and b < 0:
            raise ArithError(f"$(( {self.expr} )): exponent less than 0")
        return _OPS[op](a, b)
