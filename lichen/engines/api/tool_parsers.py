"""Tool calls in generated text: the parsers `lichen serve --tool-call-parser` and the multi-turn tool rollout use.

A parser turns a model's raw output into (content, tool calls). The built-in one reads the Hermes / Qwen format
that Qwen2.5/Qwen3 chat templates teach (SGLang's `qwen25` / `hermes` parsers read the same):

    some text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A block whose body is not a JSON object with a string "name" (and an object or JSON-string "arguments") is not a
call: it stays in the content, as does an unclosed `<tool_call>` at the end, so nothing the model wrote is lost.
The content is the generated text with exactly the parsed calls' blocks removed, whitespace around them included
as generated (a reply without a call is returned unchanged, a whitespace-only one too), so a client that compares
the tokens with the text sees the same characters. SGLang's detectors strip the text before the first call and drop
what follows the calls; lichen keeps every character outside them.

A plug-in parser is named by dotted path (`--tool-call-parser package.module.Factory`): the attribute is called
with no arguments and returns an object with `parse(text) -> ParsedOutput` and `stream() -> StreamParser`
(see the `ToolCallParser` protocol).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Callable, Protocol

from lichen.errors import ConfigError
from lichen.plugins import load_function

FLAG = "--tool-call-parser"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: `arguments` is JSON text (as OpenAI sends it), `id` is unique per call."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict:
        """The OpenAI `tool_calls[]` entry (with `index` for a streaming delta)."""
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True)
class ParsedOutput:
    # the text outside the calls exactly as generated (no call parsed: the whole text, unchanged); None only when
    # calls were parsed and not one character is left (OpenAI's null content beside tool_calls)
    content: str | None
    calls: list[ToolCall]
    # why each closed block that is not a call failed (its text stays in `content`), in order: the tool rollout
    # answers each with an error the model reads; a plug-in parser may leave it empty
    malformed: list[str] = field(default_factory=list)


class StreamParser(Protocol):
    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """`text` is the whole output so far; returns (new content, newly completed calls)."""


class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedOutput: ...

    def stream(self) -> StreamParser: ...


# Limits on what one output may hold (hostile model text; docs/serving.md "Tool-call parsing limits"). A call's
# JSON body is parsed only after these checks, so a turn of nested brackets is a malformed call, not a
# RecursionError, and the work per output stays linear in its length.
MAX_CALL_CHARS = 256 * 1024  # characters between <tool_call> and </tool_call> (far above any real call)
MAX_CALL_DEPTH = 64  # nesting of JSON objects/arrays in one call (arguments rarely nest beyond a few levels)
MAX_CALLS = 64  # calls per output; later blocks stay in the content as malformed
_JSON_TOKEN = re.compile(r'\\.|["\[\]{}]', re.DOTALL)  # an escape, a quote or a bracket


def json_depth_exceeds(body: str, limit: int) -> bool:
    """Whether the JSON text `body` nests objects/arrays deeper than `limit`, in one linear pass without
    recursion (brackets inside strings do not count; an escape is skipped whole)."""
    depth, in_string = 0, False
    for m in _JSON_TOKEN.finditer(body):
        c = m.group()
        if c == '"':
            in_string = not in_string
        elif in_string or len(c) == 2:  # inside a string, or an escape outside one (invalid JSON anyway)
            continue
        elif c in "[{":
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False


def check_call(body: str) -> ToolCall | str:
    """The call in the JSON body of one block, or why it is not one (a short reason that quotes none of the
    body): {"name": str, "arguments": object or JSON string of one}, within MAX_CALL_CHARS and MAX_CALL_DEPTH."""
    if len(body) > MAX_CALL_CHARS:
        return f"the call is longer than {MAX_CALL_CHARS} characters"
    if json_depth_exceeds(body, MAX_CALL_DEPTH):
        return f"the call nests deeper than {MAX_CALL_DEPTH} levels"
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:  # RecursionError: belt and braces, the depth check comes first
        return f"the call is not valid JSON ({str(e)[:120]})"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return 'the call is not a JSON object with a non-empty string "name"'
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string, as OpenAI sends them
        if json_depth_exceeds(args, MAX_CALL_DEPTH):
            return f"the call's arguments nest deeper than {MAX_CALL_DEPTH} levels"
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return "the call's arguments string is not valid JSON"
    if not isinstance(args, dict):
        return 'the call\'s "arguments" is not a JSON object'
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def call_from_json(body: str) -> ToolCall | None:
    """A call from the JSON body of one block, or None when it is not one (see `check_call`)."""
    call = check_call(body)
    return call if isinstance(call, ToolCall) else None


@dataclass(frozen=True)
class Malformed:
    """A closed block that is not a call: its text stays in the content, `reason` says why (for the model)."""

    text: str
    reason: str


def _partial_suffix(text: str, start: int, tag: str) -> int:
    """Length of the longest end of `text[start:]` that is a proper prefix of `tag` (held back while streaming)."""
    for k in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:k], start):
            return k
    return 0


class TaggedJsonParser:
    """`<open>{json}</close>` blocks anywhere in the text (Hermes / Qwen: `<tool_call>` ... `</tool_call>`)."""

    def __init__(self, open_tag: str = "<tool_call>", close_tag: str = "</tool_call>"):
        self.open_tag, self.close_tag = open_tag, close_tag

    def segments(self, text: str, final: bool = True) -> tuple[list[str | ToolCall | Malformed], int]:
        """The text split into content strings, calls and malformed blocks, and how many characters were
        consumed (the rest may still become a call: an open block without its close, or a partial open tag)."""
        scan = _Scan(self)
        return scan.advance(text, final), scan.pos

    def parse(self, text: str) -> ParsedOutput:
        segs, _ = self.segments(text)
        content = "".join(s if isinstance(s, str) else s.text for s in segs if not isinstance(s, ToolCall))
        calls = [s for s in segs if isinstance(s, ToolCall)]
        return ParsedOutput(
            None if calls and not content else content,
            calls,
            [s.reason for s in segs if isinstance(s, Malformed)],
        )

    def stream(self) -> "TaggedJsonStream":
        return TaggedJsonStream(self)


class _Scan:
    """The scan of one output, resumable: each call of `advance` with the output grown looks only at what it has
    not looked at (a tag split across chunks is re-read, at most a tag's length), so streaming N characters in any
    number of chunks costs O(N). `scanned` counts the characters looked at (the tests read it)."""

    def __init__(self, parser: TaggedJsonParser):
        self.open_tag, self.close_tag = parser.open_tag, parser.close_tag
        self.pos = 0  # characters consumed (returned as segments)
        self.open_at = -1  # start of a block whose close tag has not come yet, -1 when none
        self.close_from = 0  # where the search for that block's close tag resumes
        self.calls = 0
        self.scanned = 0

    def advance(self, text: str, final: bool) -> list[str | ToolCall | Malformed]:
        out: list[str | ToolCall | Malformed] = []
        while True:
            if self.open_at < 0:
                i = text.find(self.open_tag, self.pos)
                if i < 0:
                    self.scanned += max(len(text) - self.pos, 0)
                    end = len(text) if final else len(text) - _partial_suffix(text, self.pos, self.open_tag)
                    end = max(end, self.pos)  # an output that shrank (never expected) re-sends nothing
                    out.append(text[self.pos : end])
                    self.pos = end
                    return out
                self.scanned += i + len(self.open_tag) - self.pos
                out.append(text[self.pos : i])
                self.pos = self.open_at = i
                self.close_from = i + len(self.open_tag)
            j = text.find(self.close_tag, self.close_from)
            if j < 0:
                self.scanned += max(len(text) - self.close_from, 0)
                if final:  # never closed: content
                    out.append(text[self.open_at :])
                    self.pos, self.open_at = len(text), -1
                    return out
                # resume where the close tag may have begun (a partial tag at the end), not at the block
                tail = len(text) - _partial_suffix(text, self.close_from, self.close_tag)
                self.close_from = max(self.close_from, tail)
                return out
            self.scanned += j + len(self.close_tag) - self.close_from
            end = j + len(self.close_tag)
            block = text[self.open_at : end]
            body = text[self.open_at + len(self.open_tag) : j].strip()
            self.scanned += len(body)
            call = check_call(body) if self.calls < MAX_CALLS else f"more than {MAX_CALLS} calls in one output"
            if isinstance(call, ToolCall):
                self.calls += 1
                out.append(call)
            else:
                out.append(Malformed(block, call))
            self.pos, self.open_at = end, -1


class TaggedJsonStream:
    """Streaming state of one choice: content is sent as soon as it cannot be the start of a call, a call once its
    block closed. Nothing else is held back or trimmed, so the streamed content joins to exactly `parse`'s."""

    def __init__(self, parser: TaggedJsonParser):
        self.scan = _Scan(parser)

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        content, calls = [], []
        for s in self.scan.advance(text, final):
            if isinstance(s, ToolCall):
                calls.append(s)
            else:
                content.append(s.text if isinstance(s, Malformed) else s)
        return "".join(content), calls


BUILTIN: dict[str, Callable[[], ToolCallParser]] = {
    "hermes": TaggedJsonParser,
    "qwen": TaggedJsonParser,
    "qwen25": TaggedJsonParser,
    "qwen3": TaggedJsonParser,
}


def tool_finish_reason(reason: str | None, calls: int) -> str | None:
    """OpenAI's finish_reason for a reply: "tool_calls" when it stopped after making calls."""
    return "tool_calls" if calls and reason == "stop" else reason


def load_parser(name: str | None, flag: str = FLAG) -> ToolCallParser | None:
    """A built-in parser by name, a plug-in by dotted path, or None for "none" (no parsing)."""
    if name is None or name == "none":
        return None
    if name in BUILTIN:
        return BUILTIN[name]()
    if "." not in name:
        raise ConfigError(
            f"{flag} {name!r}: unknown parser; use one of {sorted(BUILTIN)}, none, or a dotted path "
            "package.module.Factory"
        )
    parser = load_function(name, flag)()
    if not callable(getattr(parser, "parse", None)) or not callable(getattr(parser, "stream", None)):
        raise ConfigError(f"{flag} {name!r}: what it returns needs parse(text) and stream() methods")
    return parser
