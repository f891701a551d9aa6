"""A `stream=True` reply of the agent proxy (lichen/rollout/agent_proxy.py) as the engine generates it: OpenAI
chat-completion chunks over SSE, the way `lichen serve` streams chat (lichen/engines/server/openai_api.py): a role chunk,
then after every engine step the new text run through the tool-call parser's stream state (`feed(text so far,
final)`: content once it cannot start a call, each call once its block closed), the log-probs of the step's tokens
when asked, the finish reason with the last chunk, [DONE].

The engine streams through `agenerate_stream(GenRequest, session_id)` (GenResults with the tokens so far and
finish_reason None, then the final one); an engine with only `agenerate` gives its finished reply as one step.

A reply counts once its last chunk (the one with the finish reason) is written: `ReplyStream.run` calls `record`
then, before [DONE], so an agent that sends its next request as soon as the stream ends finds the turn recorded. A
client that goes away mid-stream gets nothing recorded and its generation is closed (docs/agentic.md#agent-proxy
says why).
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, AsyncIterator, Callable

from aiohttp import web

from lichen.engines.api.engine_protocol import AsyncEngine
from lichen.engines.api.protocol import stream_error
from lichen.engines.api.tool_parsers import ToolCallParser, tool_finish_reason
from lichen.engines.core.engine import GenRequest, GenResult


def token_logprobs(tok: Any, ids: list[int], logprobs: list[float]) -> list[dict]:
    """OpenAI's `logprobs.content` entries of some output tokens."""
    return [
        {"token": tok.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []} for t, lp in zip(ids, logprobs)
    ]


def generation(engine: AsyncEngine, request: GenRequest, session_id: str) -> AsyncIterator[GenResult]:
    """The engine's `agenerate_stream`, or its `agenerate` as a stream of one (finished) step."""
    stream = getattr(engine, "agenerate_stream", None)
    return stream(request, session_id) if stream is not None else _whole(engine.agenerate(request, session_id))


async def _whole(reply: Any) -> AsyncIterator[GenResult]:
    yield await reply


Record = Callable[[GenResult, "str | None", "list[dict] | None"], None]


class ReplyStream:
    """One streamed reply; `run` calls `record(final result, content, calls)` with the content and calls as the
    client assembles them from the deltas (the calls with the ids sent)."""

    def __init__(self, tok: Any, parser: ToolCallParser | None, *, logprobs: bool, cid: str, model: str):
        self.tok, self.want_lp = tok, logprobs
        self.parser = parser.stream() if parser is not None else None
        self.base = {"id": cid, "object": "chat.completion.chunk", "created": 0, "model": model}
        self.text = ""  # the content sent (without a parser: the text)
        self.lp_sent = 0  # tokens whose log-probs were sent
        self.calls: list[dict] = []

    async def run(self, request: web.Request, results: AsyncIterator[GenResult], record: Record) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            async with contextlib.aclosing(results):  # leaving early closes the generation
                await self._write(resp, {"role": "assistant", "content": ""}, None, None)
                async for res in results:
                    await self._step(resp, res)
                    if res.finish_reason is not None:  # its last chunk is written
                        record(res, self.text or None, self.calls or None)
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionResetError:  # the client went away: nothing (more) is written
            pass
        except Exception as e:  # noqa: BLE001 - an engine error after the stream started: an error event
            await stream_error(resp, e)
        return resp

    async def _step(self, resp: web.StreamResponse, res: GenResult) -> None:
        final = res.finish_reason is not None
        text = self.tok.decode(res.output_ids, skip_special_tokens=True)
        if not final:  # a character whose bytes are still being generated decodes to U+FFFD: held back
            text = text.rstrip("\ufffd")
        msg: dict = {}
        if self.parser is not None:
            delta, calls = self.parser.feed(text, final)
            if calls:
                msg["tool_calls"] = [c.openai(len(self.calls) + k) for k, c in enumerate(calls)]
                self.calls += [c.openai() for c in calls]
        else:
            delta = text[len(self.text) :] if text.startswith(self.text) else ""
        self.text += delta
        if delta:
            msg = {"content": delta, **msg}
        reason = tool_finish_reason(res.finish_reason, len(self.calls)) if final else None
        if msg or final:
            n = len(res.output_ids)
            lps = None
            if self.want_lp:  # every token since the last chunk, also those whose text was held back
                lps = {
                    "content": token_logprobs(
                        self.tok, res.output_ids[self.lp_sent : n], res.output_logprobs[self.lp_sent : n]
                    )
                }
                self.lp_sent = n
            await self._write(resp, msg, lps, reason)

    async def _write(self, resp: web.StreamResponse, delta: dict, lps: dict | None, reason: str | None) -> None:
        chunk = {**self.base, "choices": [{"index": 0, "delta": delta, "logprobs": lps, "finish_reason": reason}]}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
