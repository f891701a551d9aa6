"""The `code` reward: the fraction of a sample's test cases that the response's program passes, run sandboxed.

The program is the last fenced code block of the response (```python, ```py or a bare ```), looked for after
the last `</think>` when there is one; a response without a code block scores 0.0.

Test cases come from `metadata["test_cases"]`, else the label (a JSON string is decoded), in one of the forms:
- stdin/stdout: `{"inputs": [str, ...], "outputs": [str, ...]}` or `[{"input": str, "output": str}, ...]`.
  Each case is one sandboxed run with that stdin; it passes iff the program exits 0 and its stdout matches
  the expected text token by token (whitespace-insensitive; two tokens that both parse as numbers match when
  |a - b| <= 1e-6 * max(1, |b|));
- call-based: `{"fn_name": "f", "inputs": [[arg, ...], ...], "outputs": [value, ...]}`: case i passes iff
  `f(*inputs[i])` equals outputs[i] (tuples compare as lists; an expected value given as a one-element list
  also matches the bare element, as in APPS);
- asserts: `["assert f(1) == 2", ...]` or `{"asserts": [...]}`: case i passes iff its statement runs without
  an exception after the program's top level ran (with `__name__` != "__main__").
Call-based and assert cases run in one sandboxed process (timeout = per-case timeout x number of cases) that
reports each case as it finishes, so a hanging case costs only itself and the ones after it. Results are
marked with a random nonce that the program never sees in its files or argv.
reward = passed cases / all cases. A malformed test-case spec raises (the sample is marked failed).
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from lichen.rewards.deepscaler import after_thinking
from lichen.rewards.sandbox import SandboxConfig, SandboxLimits, run_sandboxed

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

HARNESS = r'''
import json, os, sys


def __lichen_eq__(got, want):
    def plain(x):
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x

    def same(a, b):
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


def __lichen_run__():
    header = json.loads(sys.stdin.readline())
    mark, tests = header.pop("nonce"), header.pop("tests")
    report = os.fdopen(os.dup(1), "w")
    sys.stdin = open(os.devnull)
    scope = {"__name__": "__lichen_solution__", "__lichen_eq__": __lichen_eq__, "json": json}
    try:
        with open("solution.py") as f:
            exec(compile(f.read(), "solution.py", "exec"), scope)
    except BaseException as e:
        print(mark, "load", type(e).__name__, file=report, flush=True)
        return
    for i, test in enumerate(tests):
        try:
            exec(compile(test, "<test %d>" % i, "exec"), scope)
            ok = 1
        except BaseException:
            ok = 0
        print(mark, i, ok, file=report, flush=True)


__lichen_run__()
'''


def extract_code(response: str) -> str | None:
    """The last fenced code block (after the last `</think>` when present), or None."""
    answer = after_thinking(response)
    blocks = _FENCE.findall(response if answer is None else answer)
    return blocks[-1] if blocks else None


def parse_test_cases(label: Any, metadata: dict | None) -> tuple[str, list]:
    """("stdio", [(input, output), ...]) or ("asserts", [statement, ...]); raises ValueError when malformed."""
    spec = (metadata or {}).get("test_cases", label)
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"code: test cases are a string but not JSON: {e.msg}") from None
    if isinstance(spec, dict) and "asserts" in spec:
        spec = spec["asserts"]
    if isinstance(spec, list) and spec and all(isinstance(t, str) for t in spec):
        return "asserts", list(spec)
    if isinstance(spec, list) and spec and all(isinstance(t, dict) for t in spec):
        try:
            return "stdio", [(str(t["input"]), str(t["output"])) for t in spec]
        except KeyError as e:
            raise ValueError(f"code: a stdin/stdout test case has no {e.args[0]!r} key") from None
    if isinstance(spec, dict) and "inputs" in spec and "outputs" in spec:
        inputs, outputs = spec["inputs"], spec["outputs"]
        if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
            raise ValueError("code: 'inputs' and 'outputs' must be lists of the same length")
        if not inputs:
            raise ValueError("code: no test cases")
        fn_name = spec.get("fn_name")
        if fn_name:
            if not str(fn_name).isidentifier():
                raise ValueError(f"code: fn_name {fn_name!r} is not a Python identifier")
            return "asserts", [_call_assert(str(fn_name), args, want) for args, want in zip(inputs, outputs)]
        return "stdio", [(str(i), str(o)) for i, o in zip(inputs, outputs)]
    raise ValueError(
        "code: no test cases; give metadata['test_cases'] or a label as {'inputs': [...], 'outputs': [...]} "
        "(optionally with 'fn_name'), [{'input': ..., 'output': ...}], or a list of assert statements"
    )


def _call_assert(fn_name: str, args: Any, want: Any) -> str:
    args = args if isinstance(args, list) else [args]
    return (f"assert __lichen_eq__({fn_name}(*json.loads({json.dumps(args)!r})), "
            f"json.loads({json.dumps(want)!r}))")


def outputs_match(got: str, want: str) -> bool:
    a, b = got.split(), want.split()
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x == y:
            continue
        try:
            fx, fy = float(x), float(y)
        except ValueError:
            return False
        if not abs(fx - fy) <= 1e-6 * max(1.0, abs(fy)):
            return False
    return True


class CodeReward:
    """`code` grading with one sandbox configuration (see the module docstring)."""

    def __init__(self, sandbox: SandboxConfig, case_timeout_s: float = 5.0) -> None:
        self.sandbox = sandbox
        self.case_timeout_s = case_timeout_s

    def _config(self, timeout_s: float) -> SandboxConfig:
        base = self.sandbox.limits
        limits = SandboxLimits(timeout_s=timeout_s, memory_mb=base.memory_mb, max_procs=base.max_procs,
                               max_file_mb=base.max_file_mb, max_open_files=base.max_open_files,
                               tmpfs_mb=base.tmpfs_mb, max_output_bytes=base.max_output_bytes)
        return SandboxConfig(self.sandbox.python, self.sandbox.mode, self.sandbox.uid_base, limits)

    async def grade(self, response: str, label: Any, metadata: dict | None = None) -> float:
        kind, cases = parse_test_cases(label, metadata)
        program = extract_code(response)
        if program is None:
            return 0.0
        if kind == "stdio":
            passed = 0
            config = self._config(self.case_timeout_s)
            for stdin, want in cases:
                result = await run_sandboxed(program, config=config, stdin=stdin)
                passed += result.ok and outputs_match(result.stdout, want)
            return passed / len(cases)
        return await self._run_asserts(program, cases) / len(cases)

    async def _run_asserts(self, program: str, tests: list[str]) -> int:
        nonce = secrets.token_hex(16)
        header = json.dumps({"nonce": nonce, "tests": tests}) + "\n"
        result = await run_sandboxed(program, config=self._config(self.case_timeout_s * len(tests)),
                                     stdin=header, files={"harness.py": HARNESS}, argv=["harness.py"])
        passed = set()
        for line in result.stdout.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == nonce and parts[2] == "1" and parts[1].isdigit():
                passed.add(int(parts[1]))
        return len(passed & set(range(len(tests))))
