"""Hostile tool-call text (issue 33, item 2): nesting, size and count limits make a malformed call a failed call,
never an exception — in the parser, in the multi-turn tool rollout (the model reads why and the trajectory goes
on) and on `lichen serve`'s endpoint (a 200 with the text as content) — and streaming parses in linear work."""

from __future__ import annotations

import json

import pytest
from helpers.tool_calls import CALL, MSGS, TOOLS, scripted  # noqa: F401 - `scripted` is a fixture
from helpers.tool_rollout import enc, rollout

from lichen.engines.api.tool_parsers import (
    MAX_CALL_CHARS,
    MAX_CALL_DEPTH,
    MAX_CALLS,
    ParsedOutput,
    TaggedJsonParser,
    json_depth_exceeds,
)
from lichen.models.tokenizer import load_tokenizer

P = TaggedJsonParser()
DEEP = "<tool_call>" + "[" * 3000 + "]" * 3000 + "</tool_call>"  # the attack: RecursionError in json.loads
DEEP_ARGS = '<tool_call>{"name": "add", "arguments": "' + "[" * 3000 + '"}</tool_call>'
DEEP_OBJ = '<tool_call>{"name": "add", "arguments": ' + '{"a": ' * 3000 + "1" + "}" * 3001 + "</tool_call>"


@pytest.mark.parametrize(
    "text, words",
    [
        (DEEP, f"nests deeper than {MAX_CALL_DEPTH}"),
        (DEEP_ARGS, f"arguments nest deeper than {MAX_CALL_DEPTH}"),
        (DEEP_OBJ, f"nests deeper than {MAX_CALL_DEPTH}"),
        ('<tool_call>{"name": "add", "arguments": {"s": "' + "x" * MAX_CALL_CHARS + '"}}</tool_call>', "longer than"),
        ('<tool_call>{"name": "add", "arguments": {</tool_call>', "not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'non-empty string "name"'),
    ],
)
def test_a_malformed_call_is_reported_and_stays_in_the_content(text, words):
    out = P.parse("before " + text)
    assert out.calls == [] and out.content == ("before " + text).strip()
    (reason,) = out.malformed
    assert words in reason and len(reason) < 300  # the reason never quotes the hostile body


def test_depth_check_counts_brackets_outside_strings_only():
    assert not json_depth_exceeds('{"a": "[[[[[[[[[[", "b": [[1]]}', 3)
    assert json_depth_exceeds('{"a": "\\"[", "b": [[[1]]]}', 3)  # an escaped quote does not end the string
    assert not json_depth_exceeds("[" * 64 + "]" * 64, 64) and json_depth_exceeds("[" * 65, 64)
    deep_inside = '{"name": "f", "arguments": {"x": "' + "[" * 5000 + '"}}'
    (call,) = P.parse(f"<tool_call>{deep_inside}</tool_call>").calls  # brackets in a string are text
    assert json.loads(call.arguments) == {"x": "[" * 5000}


def test_calls_beyond_the_per_output_cap_are_malformed():
    out = P.parse(CALL * (MAX_CALLS + 2))
    assert len(out.calls) == MAX_CALLS and len(out.malformed) == 2
    assert all(f"more than {MAX_CALLS} calls" in r for r in out.malformed)


def test_the_stream_survives_the_attack_and_joins_to_the_parse():
    st = P.stream()
    text = "x " + DEEP + " " + CALL
    content, calls = "", []
    for end in range(1, len(text) + 1):
        delta, new = st.feed(text[:end], end == len(text))
        content, calls = content + delta, calls + new
    whole = P.parse(text)
    assert content == whole.content and [c.name for c in calls] == ["add"] == [c.name for c in whole.calls]


def _stream_work(n: int, chunk: int) -> int:
    """Characters the stream looked at for an output with an n-character call, fed `chunk` characters at a time."""
    text = 'ok <tool_call>{"name": "add", "arguments": {"s": "' + "a" * n + '"}}</tool_call> done'
    st = P.stream()
    for end in [*range(chunk, len(text), chunk), len(text)]:
        st.feed(text[:end], end == len(text))
    return st.scan.scanned


def test_streaming_work_is_linear_in_the_output():
    """Fed one character at a time (the worst case), the scan looks at each character a bounded number of times:
    re-scanning the open block per chunk (the old parser) would look at ~n²/2 characters."""
    small, large = _stream_work(4000, 1), _stream_work(16000, 1)
    assert large <= 3 * 16100 and large < 4.5 * small  # quadratic would be ~16x
    assert _stream_work(16000, 7) <= large


# ---- the tool rollout: the model is told, the trajectory goes on -------------------------------------------------
@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return load_tokenizer(tiny_ckpt)


def test_rollout_answers_a_malformed_call_with_an_error_and_goes_on(tok):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    turns = [enc(tok, "let me " + DEEP + " and " + CALL) + [im_end], enc(tok, "It is 3.") + [im_end]]
    out, engine = rollout(tok, turns, budget=20000)
    assert len(engine.requests) == 2 and out.status.name == "COMPLETED" and out.metadata["stop"] == "answer"
    ok, bad = out.metadata["tool_calls"]
    assert (ok["name"], ok["result"]) == ("add", "3")
    assert bad["name"] is None and bad["result"].startswith("error: invalid tool call: the call nests deeper than")
    tool_text = tok.decode(engine.requests[1].input_ids)
    assert bad["result"] in tool_text  # the policy reads why its call failed


class RaisingParser:
    """A plug-in parser with a bug hostile text triggers."""

    def parse(self, text):
        raise RecursionError("maximum recursion depth exceeded")

    def stream(self):
        raise NotImplementedError


class PlainParser:
    """A plug-in whose ParsedOutput has no `malformed` (built positionally, as before it existed)."""

    def parse(self, text):
        return ParsedOutput(text, [])

    def stream(self):
        raise NotImplementedError


def test_a_raising_plugin_parser_fails_the_call_not_the_run(tok):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    out, engine = rollout(
        tok, [enc(tok, CALL) + [im_end]] * 2, max_turns=2, tool_call_parser="test_tool_parsing_limits.RaisingParser"
    )
    assert len(engine.requests) == 2
    assert [c["result"] for c in out.metadata["tool_calls"]] == [
        "error: invalid tool call: the tool-call parser could not read this turn; "
        + 'write one JSON object {"name": ..., "arguments": {...}} per <tool_call></tool_call> block'
    ] * 2
    out, engine = rollout(tok, [enc(tok, CALL) + [im_end]], tool_call_parser="test_tool_parsing_limits.PlainParser")
    assert out.metadata["stop"] == "answer" and out.metadata["tool_calls"] == []


# ---- lichen serve: the attack is a 200 whose content is the text --------------------------------------------------
@pytest.mark.slow
def test_serve_answers_the_attack_with_content(scripted):  # noqa: F811 - the fixture
    s = scripted("x " + DEEP)
    r = s.client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS)
    assert r.choices[0].message.content == "x " + DEEP and not r.choices[0].message.tool_calls
    chunks = list(s.client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "x " + DEEP
    assert chunks[-1].choices[0].finish_reason == "stop"
