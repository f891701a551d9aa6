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
- asserts: `["assert f(1) == 2", ...]` or `{"asserts": [...]}`: case i passes iff its assert holds after the
  program's top level ran (with `__name__` != "__main__"); see code_checks.py for the forms that are accepted.
Call-based and assert cases run in one sandboxed process (timeout = per-case timeout x number of cases) that
evaluates only the program's side of each case and reports the values as plain data; the trainer compares them
with the expected values, which never enter the sandbox, so neither the program's output nor its exit status is
ever a verdict for these cases. The reported values are decoded within a budget (code_checks.py: depth, number of
values, members of a set that hash alike) and judged on a worker thread under the run's timeout, so a hostile
report fails its own cases and costs the other samples nothing. An assert that cannot be split this way fails
(closed) with a logged warning.
reward = passed cases / all cases. A malformed test-case spec raises (the sample is marked failed).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from lichen.rewards.code_checks import Case, call_case, count_passed, split_assert
from lichen.rewards.deepscaler import after_thinking
from lichen.rewards.runner import in_daemon_thread
from lichen.rewards.sandbox import SandboxConfig, run_sandboxed

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

logger = logging.getLogger(__name__)

HARNESS = Path(__file__).with_name("_code_harness.py").read_text()


def extract_code(response: str) -> str | None:
    """The last fenced code block (after the last `</think>` when present), or None."""
    answer = after_thinking(response)
    blocks = _FENCE.findall(response if answer is None else answer)
    return blocks[-1] if blocks else None


def parse_test_cases(label: Any, metadata: dict | None) -> tuple[str, list]:
    """("stdio", [(input, output), ...]) or ("checks", [Case, ...]); raises ValueError when malformed."""
    spec = (metadata or {}).get("test_cases", label)
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"code: test cases are a string but not JSON: {e.msg}") from None
    if isinstance(spec, dict) and "asserts" in spec:
        spec = spec["asserts"]
    if isinstance(spec, list) and spec and all(isinstance(t, str) for t in spec):
        return "checks", [split_assert(t) for t in spec]
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
            try:
                return "checks", [call_case(str(fn_name), args, want) for args, want in zip(inputs, outputs)]
            except (TypeError, ValueError) as e:
                raise ValueError(f"code: call arguments must be JSON values: {e}") from None
        return "stdio", [(str(i), str(o)) for i, o in zip(inputs, outputs)]
    raise ValueError(
        "code: no test cases; give metadata['test_cases'] or a label as {'inputs': [...], 'outputs': [...]} "
        "(optionally with 'fn_name'), [{'input': ..., 'output': ...}], or a list of assert statements"
    )


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
        return self.sandbox.with_limits(replace(self.sandbox.limits, timeout_s=timeout_s, cpu_s=None))

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
        return await self._run_checks(program, cases) / len(cases)

    async def _run_checks(self, program: str, cases: list[Case]) -> int:
        """Passed cases: the sandbox reports each probe's value, the verdicts are computed here."""
        probes = [check.probe for case in cases for check in case.checks]
        if not probes:
            return 0
        header = json.dumps({"probes": probes}) + "\n"
        result = await run_sandboxed(
            program,
            config=self._config(self.case_timeout_s * len(cases)),
            stdin=header,
            files={"harness.py": HARNESS},
            argv=["harness.py"],
        )
        # the values and verdicts are the program's data: off the event loop (other samples' sandboxes keep their
        # timers) and under the same timeout as the run; a thread that overruns is abandoned, its result dropped
        timeout = self.case_timeout_s * len(cases)
        try:
            return await asyncio.wait_for(in_daemon_thread(count_passed, cases, result.stdout, len(probes)), timeout)
        except asyncio.TimeoutError:
            logger.warning(
                "code reward: checking the values a program reported took over %gs; its cases count as failed", timeout
            )
            return 0
