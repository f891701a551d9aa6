"""The reward hub: every built-in rm type behind one `fn(args, sample)`, chosen by `--rm-type` or per sample.

rm types (each module's docstring has the exact rule):
    exact, leading_number   rules.py          plain string rules
    math                    math_grader.py    last \\boxed{} answer (slime's rule), math-verify equivalence
    math_lenient            math_grader.py    math, or the last number when nothing is boxed
    dapo                    dapo.py           last "Answer:" line of the last 300 characters; {"score": ±1, ...}
    deepscaler              deepscaler.py     math on the text after the last </think> (or ###Response)
    deepscaler_lenient      deepscaler.py     math_lenient on the text after the last </think>
    f1                      f1.py             SQuAD token F1
    gpqa                    gpqa.py           multiple-choice letter
    code                    code_reward.py    pass fraction of test cases, run in sandbox.py
    remote_rm               remote.py         POST to --rm-url
    boxed_<t>               (this module)     <t> applied to the last \\boxed{} content only, for t in BOXABLE
A sample whose `metadata["rm_type"]` is set is graded by that type instead of the hub's own. The `code` sandbox
and the remote client are built on first use, so a math run with a few code samples still works; with
`--rm-type code` the sandbox is checked when the hub is built, before any model loads.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any, AsyncIterator

from lichen.errors import ConfigError
from lichen.rewards.dapo import dapo_equal, grade_dapo, normalize_final_answer
from lichen.rewards.deepscaler import grade_deepscaler, grade_deepscaler_lenient
from lichen.rewards.f1 import grade_f1
from lichen.rewards.gpqa import grade_gpqa
from lichen.rewards.math_grader import grade_math, grade_math_lenient, label_answer, math_equal
from lichen.rewards.rules import RuleFn, exact, last_boxed, leading_number
from lichen.types import Sample

BOXED_PREFIX = "boxed_"

RULES: dict[str, RuleFn] = {
    "exact": exact,
    "leading_number": leading_number,
    "math": grade_math,
    "math_lenient": grade_math_lenient,
    "dapo": grade_dapo,
    "deepscaler": grade_deepscaler,
    "deepscaler_lenient": grade_deepscaler_lenient,
    "f1": grade_f1,
    "gpqa": grade_gpqa,
}
ASYNC_TYPES = ("code", "remote_rm")


def _boxed_math(answer: str, label: Any, metadata: dict) -> float:
    ref = label_answer(label)
    return 1.0 if ref is not None and math_equal(answer, ref) else 0.0


def _boxed_dapo(answer: str, label: Any, metadata: dict) -> dict:
    ok = label is not None and dapo_equal(answer, str(label))
    return {"score": 1.0 if ok else -1.0, "acc": ok, "pred": normalize_final_answer(answer)}


# how each boxable type grades a bare answer (the box's content) rather than a whole response
BOXABLE: dict[str, RuleFn] = {
    "exact": exact,
    "leading_number": leading_number,
    "math": _boxed_math,
    "dapo": _boxed_dapo,
    "f1": grade_f1,
    "gpqa": grade_gpqa,
}


def known_rm_types() -> list[str]:
    return sorted(RULES) + list(ASYNC_TYPES) + [BOXED_PREFIX + t for t in sorted(BOXABLE)]


def check_rm_type(rm_type: str, flag: str = "--rm-type") -> None:
    if (
        rm_type not in RULES
        and rm_type not in ASYNC_TYPES
        and not (rm_type.startswith(BOXED_PREFIX) and rm_type[len(BOXED_PREFIX) :] in BOXABLE)
    ):
        raise ConfigError(
            f"{flag} {rm_type!r} is not a known rm type; known: {', '.join(known_rm_types())} (or give "
            f"--custom-rm-path module.function for your own verifier)"
        )


def get_rule_reward(rm_type: str, flag: str = "--rm-type") -> RuleFn:
    """The synchronous grader `fn(response, label, metadata)` of a rule type (not `code` / `remote_rm`)."""
    check_rm_type(rm_type, flag)
    if rm_type in ASYNC_TYPES:
        raise ConfigError(f"{flag} {rm_type!r} runs asynchronously; it has no plain rule function")
    if rm_type.startswith(BOXED_PREFIX):
        inner_name = rm_type[len(BOXED_PREFIX) :]
        inner = BOXABLE[inner_name]

        def boxed(response: str, label: Any, metadata: dict | None = None) -> float | dict:
            answer = last_boxed(response)
            if answer is None:
                return {"score": -1.0, "acc": False, "pred": ""} if inner_name == "dapo" else 0.0
            return inner(answer, label, metadata or {})

        boxed.__name__ = rm_type
        return boxed
    return RULES[rm_type]


def grade(rm_type: str, response: str, label: Any, metadata: dict | None = None) -> float | dict:
    """Grade one response with a rule type; for use inside custom reward functions."""
    return get_rule_reward(rm_type)(response, label, metadata or {})


class RewardHub:
    """`fn(args, sample)` for the built-in rm types. `cfg` (lichen's RewardConfig: --code-*, --rm-*, --reward-*)
    sets up the code sandbox and the remote RM; rule types need none."""

    def __init__(self, rm_type: str, cfg: Any = None) -> None:
        check_rm_type(rm_type)
        self.rm_type = rm_type
        self.cfg = cfg
        self._lock = threading.Lock()
        self._code: Any = None
        self._remote: Any = None
        self._rules: dict[str, RuleFn] = {}
        if rm_type == "code":
            self._code_grader()
        elif rm_type == "remote_rm":
            self._remote_rm()
        else:
            self._rule(rm_type)

    def __repr__(self) -> str:
        return f"RewardHub({self.rm_type!r})"

    def _rule(self, rm_type: str) -> RuleFn:
        if rm_type not in self._rules:
            self._rules[rm_type] = get_rule_reward(rm_type, flag="metadata rm_type")
        return self._rules[rm_type]

    def _settings(self, rm_type: str) -> Any:
        if self.cfg is None:
            raise ConfigError(f"rm type {rm_type} needs its settings: build the hub with lichen's RewardConfig")
        return self.cfg

    def _code_grader(self) -> Any:
        with self._lock:
            if self._code is None:
                from lichen.rewards.code_reward import CodeReward
                from lichen.rewards.sandbox import SandboxLimits, resolve_sandbox

                c = self._settings("code")
                limits = SandboxLimits(
                    memory_mb=c.code_memory_mb, max_procs=c.code_max_procs, max_file_mb=c.code_max_file_mb
                )
                sandbox = resolve_sandbox(c.code_sandbox_python, uid_base=c.code_sandbox_uid_base, limits=limits)
                self._code = CodeReward(sandbox, case_timeout_s=c.code_timeout)
            return self._code

    def _remote_rm(self) -> Any:
        with self._lock:
            if self._remote is None:
                from lichen.rewards.remote_rm import RemoteRM, rm_api_key

                c = self._settings("remote_rm")
                if not c.rm_url:
                    raise ConfigError("rm type remote_rm needs --rm-url http(s)://host:port/path")
                # no --reward-timeout (0 or none) still bounds each HTTP request
                self._remote = RemoteRM(
                    c.rm_url,
                    max_retries=c.rm_max_retries,
                    backoff_s=c.rm_retry_backoff,
                    request_timeout_s=c.timeout or 60.0,
                    max_concurrency=c.concurrency,
                    api_key=rm_api_key(c.rm_api_key_file),
                )
            return self._remote

    @contextlib.asynccontextmanager
    async def batch_context(self) -> AsyncIterator[None]:
        """One HTTP session for a batch when remote rewards are in use (entered by the reward runner)."""
        if self._remote is None:
            yield
            return
        async with self._remote.batch_context():
            yield

    async def __call__(self, args: Any, sample: Sample) -> float | dict:
        metadata = sample.metadata or {}
        rm_type = metadata.get("rm_type") or self.rm_type
        if rm_type == "code":
            grader = self._code if self._code is not None else await asyncio.to_thread(self._code_grader)
            return await grader.grade(sample.response, sample.label, metadata)
        if rm_type == "remote_rm":
            remote = self._remote if self._remote is not None else self._remote_rm()
            return await remote(args, sample)
        try:
            rule = self._rule(rm_type)
        except ConfigError as e:  # a per-sample type: this sample fails, the run goes on
            raise ValueError(str(e)) from None
        return rule(sample.response, sample.label, metadata)
