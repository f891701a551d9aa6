"""The `tools` / `tool_choice` side of `/v1/chat/completions` (docs/agentic.md): what reaches the chat template,
whether the output is parsed for calls, and the refusals (never a silent ignore)."""

from __future__ import annotations

import json
from typing import Any

from lichen.engines.api.protocol import RequestError, expect


def _bad(msg: str) -> RequestError:
    return RequestError(msg, shape="object")


def check_tools(body: dict) -> list[dict] | None:
    """The request's `tools` (function tools with a name), or None when absent or empty."""
    tools = body.get("tools")
    if not tools:
        return None
    expect(tools, (list,), "tools", 'a list of {"type": "function", "function": {...}}')
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise _bad(f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}')
        if not isinstance(t["function"].get("name"), str) or not t["function"]["name"]:
            raise _bad(f"tools[{i}].function.name must be a non-empty string")
    return tools


def tool_mode(body: dict, parser: Any, parser_flag: str) -> tuple[list[dict] | None, bool]:
    """(tools to render, whether to parse calls) for this request's `tools` and `tool_choice`.

    "auto" (the default with tools) renders and parses; "none" renders no tools and parses nothing, as OpenAI's
    model then calls none. "required" and a named function need constrained decoding, which lichen's engine does
    not do, so they are refused rather than answered with a reply that might not call the tool."""
    tools = check_tools(body)
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None, False
    if choice != "auto":
        shown = json.dumps(choice)[:80]
        if tools is None:
            raise _bad(f"tool_choice {shown} needs tools; send tools or leave tool_choice out")
        raise _bad(
            f"tool_choice {shown} is not supported by lichen serve (forcing a call needs constrained "
            'decoding); use "auto" or "none"'
        )
    if tools is None:
        raise _bad('tool_choice "auto" needs tools; send tools or leave tool_choice out')
    if parser is None:
        raise _bad(
            f"this server parses no tool calls ({parser_flag} none), so tools would be ignored; restart it "
            f"with {parser_flag} hermes or leave tools out"
        )
    return tools, True


def template_messages(messages: list[dict]) -> list[dict]:
    """Assistant `tool_calls` with their JSON-string arguments decoded: chat templates (Qwen's, Llama's) write
    `arguments | tojson`, which would quote a string a second time."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls:
            expect(calls, (list,), f"messages[{i}].tool_calls", "a list of tool calls")
            fixed = []
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise _bad(f"messages[{i}].tool_calls[{j}] must have function.name")
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError:
                        raise _bad(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON") from None
                fixed.append({**c, "function": {**fn, "arguments": args}})
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


def refuse_ignored_tools(with_tools: str, without_tools: str, template_source: str) -> None:
    """A template that renders the same prompt with and without `tools` never shows them to the model: 400."""
    if with_tools == without_tools:
        raise _bad(
            f"the chat template of {template_source} ignores `tools` (the prompt is the same with and "
            "without them), so the model would never see them; serve a model whose chat template renders "
            "tools, or leave tools out"
        )
