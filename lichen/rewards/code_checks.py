"""Assert and call-based test cases, split so that the verdict is computed by the trusted trainer.

The untrusted program only ever evaluates *probes*: a call `f(*args)` or the program-side expression of an
assert (`f(x)` in `assert f(x) == y`). Each probe's value comes back as plain data (see `_code_harness.py`),
and the comparison against the expected value happens here, on builtin objects decoded from JSON. The expected
value never enters the sandbox, so a program that forges its report, patches the harness, or returns an object
whose `__eq__` is always true gains nothing: the only way to pass is to report the right values.

Supported assert forms (and `and` of them, several asserts in one case):
`assert P == E` (also `!=`, `<`, `<=`, `>`, `>=`, `in`, `not in`, `is`/`is not` None/True/False, either side),
`assert P`, `assert not P`, `assert math.isclose(P, E, rel_tol=.., abs_tol=..)`, `assert abs(P - E) < T`.
E and T must be computable here without the program: literals, `-x`, arithmetic on numbers, and the pure
builtins in `_SAFE_CALLS` (`set((1, 2))`, `float("inf")`, `sorted([...])`). P must not contain a comparison
(it would carry the expected value into the sandbox). Anything else cannot be split and fails closed.
"""

from __future__ import annotations

import ast
import json
import logging
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable

logger = logging.getLogger(__name__)


class Unsplittable(ValueError):
    """An assert whose verdict would have to be computed inside the sandbox."""


@dataclass(frozen=True)
class Check:
    probe: dict  # sent to the sandbox: {"expr": source} or {"call": name, "args": [...]}
    verdict: Callable[[Any], bool]  # applied here to the probe's decoded value


@dataclass
class Case:
    checks: list[Check]  # all must pass; empty when the case could not be split (it always fails)
    source: str = ""
    reason: str = ""  # why it could not be split


# ------------------------------------------------------------------------------------------ decoding


# The values a program reports are hostile: they are decoded within a budget, so that no report costs the trainer
# more than linear work (the sandbox's output cap bounds the report's size). A set whose members all hash alike
# (ints equal modulo 2**61 - 1 do) makes building it quadratic: ~9 s of CPU for 1 MiB; such a value is refused.
MAX_DEPTH = 100  # nesting of containers, as the harness encodes (`_code_harness.py`)
MAX_REPORT_NODES = 1_000_000  # decoded values (containers and their items) in one report, all probes together
MAX_SAME_HASH = 8  # members of one set or frozenset, or keys of one dict, that share a hash value


class OverBudget(ValueError):
    """A reported value beyond the decoding budget: its probe counts as failed."""


class Budget:
    """What is left of one report's decoding budget."""

    def __init__(self, nodes: int = MAX_REPORT_NODES) -> None:
        self.nodes = nodes

    def take(self, n: int) -> None:
        self.nodes -= n
        if self.nodes < 0:
            raise OverBudget(f"the report holds more than {MAX_REPORT_NODES} values")


def _hash_spread(items: list) -> list:
    """`items`, after checking that at most MAX_SAME_HASH of them share a hash (TypeError: an unhashable one)."""
    counts: dict[int, int] = {}  # keyed by hash values, which are distinct ints: no collisions here
    for x in items:
        h = hash(x)
        counts[h] = counts.get(h, 0) + 1
        if counts[h] > MAX_SAME_HASH:
            raise OverBudget(f"more than {MAX_SAME_HASH} members of a set or dict hash alike")
    return items


def decode(value: Any, budget: Budget | None = None, depth: int = 0) -> Any:
    """A reported value (JSON from the harness's tagged encoding) as builtin Python objects, within `budget`
    (a fresh one when None) and MAX_DEPTH; raises ValueError (OverBudget for the budgets) or TypeError."""
    budget = Budget() if budget is None else budget
    budget.take(1)
    if not isinstance(value, (list, dict)):
        return value  # None, bool, int, float, str
    if depth >= MAX_DEPTH:
        raise OverBudget(f"the value nests deeper than {MAX_DEPTH} levels")
    if isinstance(value, list):
        return [decode(v, budget, depth + 1) for v in value]
    if len(value) != 1:
        raise ValueError("not a tagged value")
    ((tag, items),) = value.items()
    if tag == "bytes" and isinstance(items, str):
        return bytes.fromhex(items)
    if not isinstance(items, list):
        raise ValueError(f"bad tagged value {tag!r}")
    if tag == "tuple":
        return tuple(decode(v, budget, depth + 1) for v in items)
    if tag in ("set", "frozenset"):
        members = _hash_spread([decode(v, budget, depth + 1) for v in items])
        return set(members) if tag == "set" else frozenset(members)
    if tag == "dict":
        pairs = []
        for pair in items:
            if not (isinstance(pair, list) and len(pair) == 2):
                raise ValueError("bad dict item")
            pairs.append((decode(pair[0], budget, depth + 1), decode(pair[1], budget, depth + 1)))
        _hash_spread([k for k, _ in pairs])
        return dict(pairs)
    raise ValueError(f"unknown tag {tag!r}")


# ------------------------------------------------------------------------ expected values (trusted side)

_SAFE_CALLS: dict[str, Callable] = {
    "set": set,
    "frozenset": frozenset,
    "tuple": tuple,
    "list": list,
    "dict": dict,
    "sorted": sorted,
    "float": float,
    "int": int,
    "str": str,
    "bool": bool,
    "abs": abs,
    "round": round,
    "bytes": bytes,
}
_ARITH = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def _number(x: Any) -> bool:
    return type(x) in (int, float)


def safe_eval(node: ast.AST) -> Any:
    """The value of an expected-value expression that needs nothing from the program; raises Unsplittable."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = [safe_eval(e) for e in node.elts]
        return {ast.Tuple: tuple, ast.List: list, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {safe_eval(k): safe_eval(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        x = safe_eval(node.operand)
        if _number(x):
            return -x if isinstance(node.op, ast.USub) else x
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
        a, b = safe_eval(node.left), safe_eval(node.right)
        # arithmetic on numbers with small exponents, and short repeats: nothing here can be made to cost much
        if _number(a) and _number(b) and not (isinstance(node.op, ast.Pow) and (abs(b) > 256 or abs(a) > 2**64)):
            try:
                return _ARITH[type(node.op)](a, b)
            except (ArithmeticError, ValueError) as e:
                raise Unsplittable(f"expected value raises {type(e).__name__}") from None
        seq, times = (a, b) if type(b) is int else (b, a)
        if (
            isinstance(node.op, ast.Mult)
            and type(seq) in (list, tuple, str)
            and type(times) is int
            and len(seq) * times <= 1_000_000
        ):  # `[0] * 5`
            return seq * times
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _SAFE_CALLS
        and not any(isinstance(a, ast.Starred) for a in node.args)
        and all(k.arg for k in node.keywords)
    ):
        args = [safe_eval(a) for a in node.args]
        kwargs = {k.arg: safe_eval(k.value) for k in node.keywords}
        try:
            return _SAFE_CALLS[node.func.id](*args, **kwargs)
        except Exception as e:  # e.g. int("x"): a broken test case
            raise Unsplittable(f"expected value raises {type(e).__name__}") from None
    raise Unsplittable(f"{ast.unparse(node)!r} is not a value computable without the program")


def _try_safe(node: ast.AST) -> tuple[bool, Any]:
    try:
        return True, safe_eval(node)
    except Unsplittable:
        return False, None


# -------------------------------------------------------------------------------------- assert parsing

_COMPARE: dict[type, Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}
_MIRROR = {ast.Lt: ast.Gt, ast.Gt: ast.Lt, ast.LtE: ast.GtE, ast.GtE: ast.LtE}


def _probe(node: ast.AST) -> dict:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Compare):
            raise Unsplittable(f"{ast.unparse(node)!r} compares inside the program's part")
    return {"expr": ast.unparse(node)}


def _guarded(fn: Callable[[Any], bool]) -> Callable[[Any], bool]:
    def verdict(value: Any) -> bool:
        try:
            return bool(fn(value))
        except Exception:  # e.g. a str compared with < to an int: the program's value is wrong
            return False

    return verdict


def _compare_check(op: ast.cmpop, left: ast.AST, right: ast.AST) -> Check:
    ok, want = _try_safe(right)
    if ok:
        program_side, cmp = left, _COMPARE[type(op)]
        fn = lambda v: cmp(v, want)  # noqa: E731
    else:
        ok, want = _try_safe(left)
        if not ok:
            raise Unsplittable("neither side of the comparison is computable without the program")
        program_side = right
        if type(op) in (ast.In, ast.NotIn):  # `E in P`: membership in the program's value
            cmp = _COMPARE[type(op)]
            fn = lambda v: cmp(want, v)  # noqa: E731
        else:
            cmp = _COMPARE[_MIRROR.get(type(op), type(op))]
            fn = lambda v: cmp(v, want)  # noqa: E731
    if type(op) in (ast.Is, ast.IsNot) and want not in (None, True, False):
        raise Unsplittable("`is` compares identity, which plain data cannot carry (only None/True/False)")
    return Check(_probe(program_side), _guarded(fn))


def _isclose_check(call: ast.Call) -> Check:
    if len(call.args) != 2 or not all(k.arg in ("rel_tol", "abs_tol") for k in call.keywords):
        raise Unsplittable("math.isclose needs two arguments and only rel_tol/abs_tol")
    kwargs = {k.arg: safe_eval(k.value) for k in call.keywords}
    ok, want = _try_safe(call.args[1])
    program_side = call.args[0]
    if not ok:
        want, program_side = safe_eval(call.args[0]), call.args[1]
    return Check(_probe(program_side), _guarded(lambda v: _number(v) and math.isclose(v, want, **kwargs)))


def _abs_diff_check(node: ast.Compare) -> Check | None:
    """`abs(P - E) < T` (or `<=`, either order inside abs), else None."""
    left = node.left
    if not (
        len(node.ops) == 1
        and isinstance(node.ops[0], (ast.Lt, ast.LtE))
        and isinstance(left, ast.Call)
        and isinstance(left.func, ast.Name)
        and left.func.id == "abs"
        and len(left.args) == 1
        and isinstance(left.args[0], ast.BinOp)
        and isinstance(left.args[0].op, ast.Sub)
    ):
        return None
    tol = safe_eval(node.comparators[0])
    diff = left.args[0]
    ok, want = _try_safe(diff.right)
    program_side = diff.left
    if not ok:
        want, program_side = safe_eval(diff.left), diff.right
    cmp = _COMPARE[type(node.ops[0])]
    return Check(_probe(program_side), _guarded(lambda v: _number(v) and cmp(abs(v - want), tol)))


def _is_isclose(node: ast.AST) -> bool:
    func = node.func if isinstance(node, ast.Call) else None
    return (
        isinstance(func, ast.Attribute)
        and func.attr == "isclose"
        and isinstance(func.value, ast.Name)
        and func.value.id == "math"
    ) or (isinstance(func, ast.Name) and func.id == "isclose")


def _checks(test: ast.AST) -> list[Check]:
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return [c for value in test.values for c in _checks(value)]
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return [Check(_probe(test.operand), _guarded(lambda v: not v))]
    if _is_isclose(test):
        return [_isclose_check(test)]
    if isinstance(test, ast.Compare):
        check = _abs_diff_check(test)
        if check is not None:
            return [check]
        if len(test.ops) != 1:
            raise Unsplittable("chained comparisons are not supported")
        return [_compare_check(test.ops[0], test.left, test.comparators[0])]
    return [Check(_probe(test), _guarded(bool))]


def split_assert(source: str) -> Case:
    """One test case (one or more assert statements) as checks; a case that cannot be split has none."""
    try:
        tree = ast.parse(source)
        if not tree.body or not all(isinstance(s, ast.Assert) for s in tree.body):
            raise Unsplittable("a test case must consist of assert statements")
        return Case([c for s in tree.body for c in _checks(s.test)], source)
    except (Unsplittable, SyntaxError, RecursionError, MemoryError) as e:
        logger.warning(
            "code reward: test case %r cannot be checked outside the sandbox (%s); it counts as failed", source[:200], e
        )
        return Case([], source, str(e))


# ---------------------------------------------------------------------------------- call-based cases


def lenient_equal(got: Any, want: Any) -> bool:
    """Call-based comparison: tuples as lists, floats within 1e-6 relative, and an expected one-element list
    also matches the bare element (as in APPS)."""

    def plain(x: Any) -> Any:
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x

    def same(a: Any, b: Any) -> bool:
        if isinstance(a, float) or isinstance(b, float):
            try:
                return abs(float(a) - float(b)) <= 1e-6 * max(1.0, abs(float(b)))
            except (TypeError, ValueError):
                return False
        if isinstance(a, list) and isinstance(b, list):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b

    got, want = plain(got), plain(want)
    return same(got, want) or (isinstance(want, list) and len(want) == 1 and same(got, want[0]))


def call_case(fn_name: str, args: Any, want: Any) -> Case:
    args = args if isinstance(args, list) else [args]
    json.dumps(args)  # the arguments travel as JSON: refuse anything else here, not in the sandbox
    return Case(
        [Check({"call": fn_name, "args": args}, _guarded(lambda v: lenient_equal(v, want)))], f"{fn_name}(*{args!r})"
    )


def parse_report(stdout: str, count: int) -> dict[int, Any]:
    """Probe index -> decoded value from the harness's report lines (first report per probe; errors, unreadable
    lines and values beyond the report's decoding budget are left out, so their checks fail)."""
    values: dict[int, Any] = {}
    budget = Budget()
    for line in stdout.splitlines():
        try:
            entry = json.loads(line)
            if not (isinstance(entry, dict) and type(entry.get("i")) is int and "value" in entry):
                continue
            if 0 <= entry["i"] < count and entry["i"] not in values:
                values[entry["i"]] = decode(entry["value"], budget)
        except (ValueError, TypeError, RecursionError):
            continue
    return values


def count_passed(cases: list[Case], stdout: str, probes: int) -> int:
    """Cases whose every check holds on the values the report gives (the trusted side of the verdict). CPU-bound
    on hostile data, bounded by the budgets above: code_reward runs it on a worker thread under a timeout."""
    values = parse_report(stdout, probes)
    passed, k = 0, 0
    for case in cases:
        ok = bool(case.checks)
        for check in case.checks:
            ok = ok and k in values and check.verdict(values[k])
            k += 1
        passed += ok
    return passed
