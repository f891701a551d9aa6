"""Tools of the multi-turn tool rollout: Python callables named by dotted path, their JSON schemas for the chat
template, and running one call with a timeout (docs/agentic.md)."""

from __future__ import annotations

import asyncio
import inspect
import json
from dataclasses import dataclass
from typing import Any, Callable

from lichen.plugins import load_function

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., Any]
    schema: dict  # the OpenAI tool entry {"type": "function", "function": {...}} the template renders


def schema_of(fn: Callable[..., Any], name: str) -> dict:
    """`fn.schema` when it has one, else a function schema from the signature (annotated int/float/str/bool/list/
    dict parameters; those without a default are required) and the docstring's first line."""
    given = getattr(fn, "schema", None)
    if given is not None:
        return given if given.get("type") == "function" else {"type": "function", "function": given}
    props, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        ann = (
            p.annotation
            if not isinstance(p.annotation, str)
            else {t.__name__: t for t in _JSON_TYPES}.get(p.annotation, inspect.Parameter.empty)
        )
        props[p.name] = {"type": _JSON_TYPES[ann]} if ann in _JSON_TYPES else {}
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    doc = (inspect.getdoc(fn) or "").strip().splitlines()
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": doc[0] if doc else "",
            "parameters": {"type": "object", "properties": props, "required": required},
        },
    }


def load_tools(paths: tuple[str, ...]) -> dict[str, Tool]:
    """name -> Tool for each dotted path (the name: the callable's `tool_name` attribute, else its __name__)."""
    tools = {}
    for path in paths:
        fn = load_function(path, "--tool-paths")
        name = getattr(fn, "tool_name", None) or getattr(fn, "__name__", path.rpartition(".")[2])
        tools[name] = Tool(name, fn, schema_of(fn, name))
    return tools


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


async def run_tool(tools: dict[str, Tool], name: str, arguments: str, timeout: float) -> str:
    """The tool's result as text; any failure (unknown tool, bad arguments, an exception, the timeout) is an
    'error: ...' text the policy sees, never an error of the rollout."""
    tool = tools.get(name)
    if tool is None:
        return f"error: unknown tool {name!r}; available: {', '.join(sorted(tools))}"
    try:
        kwargs = json.loads(arguments)
        if inspect.iscoroutinefunction(tool.fn):
            result = await asyncio.wait_for(tool.fn(**kwargs), timeout)
        else:  # a blocking tool runs in a thread so the other trajectories keep going
            result = await asyncio.wait_for(asyncio.to_thread(tool.fn, **kwargs), timeout)
    except asyncio.TimeoutError:
        return f"error: {name} timed out after {timeout:g}s"
    except Exception as e:  # noqa: BLE001 - the policy sees what went wrong
        return f"error: {type(e).__name__}: {e}"
    return _text(result)


_SANDBOX: list = []  # the resolved code sandbox, checked once per process


async def python(code: str) -> str:
    """Run a Python program and return what it prints (stdout, then stderr)."""
    # Model-written code runs only in the code sandbox (lichen/rewards/sandbox.py: no network, its own uid,
    # memory/CPU/process limits, killed on timeout or when this coroutine is cancelled by --tool-timeout).
    from lichen.rewards.sandbox import resolve_sandbox, run_sandboxed

    if not _SANDBOX:
        _SANDBOX.append(await asyncio.to_thread(resolve_sandbox))
    res = await run_sandboxed(code, config=_SANDBOX[0])
    out = "\n".join(x.strip("\n") for x in (res.stdout, res.stderr) if x.strip())
    if res.timed_out:
        out += f"\nerror: timed out after {_SANDBOX[0].limits.timeout_s:g}s"
    elif res.output_limited:
        out += "\nerror: output limit exceeded"
    elif res.returncode not in (0, None):
        out += f"\nexit code {res.returncode}"
    return out.strip()
