"""Runs inside the sandbox (standard library only; shipped as harness.py beside solution.py).

It reads one JSON line from stdin: {"probes": [{"expr": source} | {"call": name, "args": [...]}, ...]}, runs the
program's top level (`__name__` != "__main__"), then evaluates each probe and reports its value as one JSON
line {"i": index, "value": encoded} (or {"i": index, "error": type name}) on the original stdout; the program's
own prints go to stderr. It carries no expected value and no verdict: the program can forge or patch anything in
this process, and all it can change is which values it reports (see lichen/rewards/code_checks.py).
Values must be plain data: None, bool, int, float, str, bytes, and lists, tuples, sets, frozensets and dicts of
them, by exact type; any other object (a subclass, an object with a custom __eq__) is refused and its probe fails.
"""

import json
import os
import sys

MAX_DEPTH = 100


def encode(x, depth=0):
    t = type(x)
    if x is None or t is bool or t is int or t is float or t is str:
        return x
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    if t is list:
        return [encode(v, depth + 1) for v in x]
    if t is tuple or t is set or t is frozenset:
        return {t.__name__: [encode(v, depth + 1) for v in x]}
    if t is dict:
        return {"dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in x.items()]}
    if t is bytes:
        return {"bytes": x.hex()}
    raise TypeError("a %s is not plain data" % t.__name__)


def main():
    probes = json.loads(sys.stdin.readline())["probes"]
    report = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the program's prints are not the report
    sys.stdin = open(os.devnull)
    scope = {"__name__": "__lichen_solution__"}
    try:
        with open("solution.py") as f:
            exec(compile(f.read(), "solution.py", "exec"), scope)
    except BaseException as e:
        report.write(json.dumps({"load": type(e).__name__}) + "\n")
        report.flush()
        return
    for i, probe in enumerate(probes):
        try:
            if "call" in probe:
                value = scope[probe["call"]](*probe["args"])
            else:
                value = eval(compile(probe["expr"], "<probe %d>" % i, "eval"), scope)
            line = json.dumps({"i": i, "value": encode(value)})
        except BaseException as e:
            line = json.dumps({"i": i, "error": type(e).__name__})
        report.write(line + "\n")
        report.flush()


main()
