"""Tool calls in generated text: the parsers `lichen serve --tool-call-parser` and the multi-turn tool rollout use.

A parser turns a model's raw output into (content, tool calls). The built-in one reads the Hermes / Qwen format
that Qwen2.5/Qwen3 chat templates teach (SGLang's `qwen25` / `hermes` parsers read the same):

    some text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A block whose body is not a JSON object with a string "name" (and an object or JSON-string "arguments") is not a
call: it stays in the content, as does an unclosed `<tool_call>` at the end, so nothing the model wrote is lost.

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
    content: str | None  # text outside the calls, stripped; None when nothing but whitespace is left
    calls: list[ToolCall]


class StreamParser(Protocol):
    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """`text` is the whole output so far; returns (new content, newly completed calls)."""


class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedOutput: ...

    def stream(self) -> StreamParser: ...


def call_from_json(body: str) -> ToolCall | None:
    """A call from the JSON body of one block, or None when it is not {"name": str, "arguments": object}."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string, as OpenAI sends them
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag` (held back while streaming)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class TaggedJsonParser:
    """`<open>{json}</close>` blocks anywhere in the text (Hermes / Qwen: `<tool_call>` ... `</tool_call>`)."""

    def __init__(self, open_tag: str = "<tool_call>", close_tag: str = "</tool_call>"):
        self.open_tag, self.close_tag = open_tag, close_tag
        self._block = re.compile(re.escape(open_tag) + r"(.*?)" + re.escape(close_tag), re.DOTALL)

    def segments(self, text: str, final: bool = True) -> tuple[list[str | ToolCall], int]:
        """The text split into content strings and calls, and how many characters were consumed (the rest may
        still become a call: an open block without its close, or a partial open tag)."""
        out: list[str | ToolCall] = []
        pos = 0
        while True:
            i = text.find(self.open_tag, pos)
            if i < 0:
                end = len(text) if final else len(text) - _partial_suffix(text[pos:], self.open_tag)
                out.append(text[pos:end])
                return out, end
            out.append(text[pos:i])
            m = self._block.match(text, i)
            if m is None:  # open block: content at the end, held while it may still close
                if final:
                    out.append(text[i:])
                    return out, len(text)
                return out, i
            call = call_from_json(m.group(1).strip())
            out.append(call if call is not None else m.group(0))
            pos = m.end()

    def parse(self, text: str) -> ParsedOutput:
        segs, _ = self.segments(text)
        content = "".join(s for s in segs if isinstance(s, str)).strip()
        return ParsedOutput(content or None, [s for s in segs if isinstance(s, ToolCall)])

    def stream(self) -> "TaggedJsonStream":
        return TaggedJsonStream(self)


class TaggedJsonStream:
    """Streaming state of one choice: content is sent as soon as it cannot be the start of a call, a call once its
    block closed. Whitespace is held until text follows it, so the streamed content joins to `parse`'s."""

    def __init__(self, parser: TaggedJsonParser):
        self.parser = parser
        self.done = 0  # characters of the output consumed
        self.held = ""  # whitespace not sent yet
        self.sent_any = False

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        segs, used = self.parser.segments(text[self.done :], final)
        self.done += used
        content, calls = [], []
        for s in segs:
            if isinstance(s, ToolCall):
                calls.append(s)
                continue
            body = s.rstrip()
            if body.strip():
                lead = self.held + body if self.sent_any else body.lstrip()
                content.append(lead)
                self.sent_any, self.held = True, s[len(body) :]
            else:
                self.held += s
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
