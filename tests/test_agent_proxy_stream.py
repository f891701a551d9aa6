"""Streaming on the agent proxy (lichen/rollout/agent_proxy_stream.py): replies reach an `openai`-SDK client as the
engine generates them (tool calls as deltas), the recorded turn is the non-streaming one, and a client that goes
away mid-stream leaves nothing recorded."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import openai
import pytest
from helpers.agent_proxy import TOOLS, named, serving
from helpers.agent_proxy import client as _client

from lichen.engines.core.engine import Engine, GenRequest, GenResult
from lichen.models.tokenizer import load_tokenizer
from lichen.rollout.agent_proxy import AgentProxy
from lichen.rollout.custom_generate import BatchingEngine

CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 10}}</tool_call>'


class StepEngine:
    """Streams a scripted reply one token per step: `sure ` + a call of `add`, or `it is 11` once a tool answered.
    Before step `gate_at` of a reply it waits (at most 30 s) for `gate`, which the test sets once its client saw a
    chunk: a proxy that sends nothing before the generation ends never gets there."""

    def __init__(self, tok, gate_at: int | None = None):
        self.tok, self.im_end = tok, tok.convert_tokens_to_ids("<|im_end|>")
        self.gate_at, self.gate = gate_at, threading.Event()
        self.stopped_at: list[tuple[int, int]] = []  # (steps made, steps in the reply) per stream
        self.started = threading.Event()

    def reply(self, input_ids: list[int]) -> list[int]:
        text = "it is 11" if "<|im_start|>tool" in self.tok.decode(input_ids) else "sure " + CALL
        return list(self.tok.encode(text, add_special_tokens=False)) + [self.im_end]

    async def agenerate_stream(self, r, session_id=None):
        ids = self.reply(r.input_ids)
        lps = [-0.1 - 0.01 * k for k in range(len(ids))]
        n = 0
        self.started.set()
        try:
            for n in range(1, len(ids) + 1):
                if n == self.gate_at and not await asyncio.to_thread(self.gate.wait, 30):
                    raise RuntimeError("the client saw no chunk before the generation went on")
                await asyncio.sleep(0)
                yield GenResult(ids[:n], lps[:n], "stop" if n == len(ids) else None, len(r.input_ids), "3")
        finally:
            self.stopped_at.append((n, len(ids)))

    async def agenerate(self, r, session_id=None):
        res = None
        async for res in self.agenerate_stream(r, session_id):  # noqa: B007 (the last one is the result)
            pass
        return res


def _lost(p: AgentProxy) -> bool:
    return any(h.transport is None for h in p._runner.server.connections)


def _wait_handled(p: AgentProxy) -> None:
    """Until the request of the connection the client closed was handled to its end (aiohttp forgets the
    connection then)."""
    deadline = time.monotonic() + 30
    while _lost(p) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _lost(p), "the request of the closed connection was never handled to its end"


def _stream_and_whole(p: AgentProxy) -> None:
    """The same request with and without streaming (same seed): more than one content chunk comes before the last
    one, and the turn recorded from the stream (prompt ids, output ids, log-probs) is the non-streaming one's."""
    kw = dict(
        model="policy",
        messages=[{"role": "user", "content": "tell me a story"}],
        max_tokens=40,
        seed=11,
        temperature=1.0,
        logprobs=True,
    )
    whole = _client(p, "N").chat.completions.create(**kw)
    chunks = list(_client(p, "S").chat.completions.create(**kw, stream=True))
    (n,), (s,) = p.sessions[named(p, "N")].turns, p.sessions[named(p, "S")].turns
    assert len(n.output_ids) >= 20  # a long reply (the tiny model's sample for this seed)
    assert (s.prompt_ids, s.output_ids, s.logprobs, s.finish_reason) == (
        n.prompt_ids,
        n.output_ids,
        n.logprobs,
        n.finish_reason,
    )
    content = [c for c in chunks[:-1] if c.choices and c.choices[0].delta.content]
    assert len(content) > 1 and chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    streamed_lps = [e.logprob for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed_lps == [e.logprob for e in whole.choices[0].logprobs.content] == n.logprobs


def test_a_long_reply_streams_as_generated_in_process(tiny_ckpt):
    """The in-process engine behind BatchingEngine (Engine.generate's on_step)."""
    tok = load_tokenizer(tiny_ckpt)
    with serving(AgentProxy(BatchingEngine(Engine.from_pretrained(tiny_ckpt)), tok)) as p:
        _stream_and_whole(p)


@pytest.mark.slow
def test_a_long_reply_streams_as_generated_over_engine_servers(pair, tiny_ckpt):
    """Two `lichen serve` engines behind RemoteEngines (a streamed /generate through the router)."""
    p = AgentProxy(pair, load_tokenizer(tiny_ckpt))
    pair.run(p.start())
    try:
        _stream_and_whole(p)
        # a request the server refuses: an error event names its reason, and nothing is recorded
        with pytest.raises(openai.APIError, match="HTTP 400: Requested token count exceeds"):
            list(
                _client(p, "E").chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "x"}], max_tokens=10**6, stream=True
                )
            )
        assert p.samples(named(p, "E")) == []
    finally:
        pair.run(p.stop())


def test_tool_call_deltas_stream_and_the_session_continues(tiny_ckpt):
    """`sure` reaches the client while the call is still being generated; the call comes as a tool_calls delta;
    the agent sends the message back as the SDK assembled it and the proxy continues the generated tokens."""
    tok = load_tokenizer(tiny_ckpt)
    engine = StepEngine(tok, gate_at=len("sure ") + 2)
    with serving(AgentProxy(engine, tok)) as p:
        client = _client(p, "T")
        messages = [{"role": "user", "content": "add one and ten"}]
        content, calls, reasons = "", [], []
        for chunk in client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, stream=True):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            if content:
                engine.gate.set()
            calls += delta.tool_calls or []
            reasons.append(chunk.choices[0].finish_reason)
        assert content == "sure " and reasons[-1] == "tool_calls" and len(calls) == 1  # the text as generated
        assert calls[0].index == 0 and calls[0].function.name == "add"
        assert json.loads(calls[0].function.arguments) == {"a": 1, "b": 10}
        messages += [
            {
                "role": "assistant",
                "content": content,
                "tool_calls": [
                    {
                        "id": calls[0].id,
                        "type": "function",
                        "function": {"name": "add", "arguments": calls[0].function.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": calls[0].id, "content": "11"},
        ]
        r2 = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    assert r2.choices[0].message.content == "it is 11"
    (sample,) = p.samples(named(p, "T"))  # one chain: the streamed reply's tokens were reused
    first, second = p.sessions[named(p, "T")].turns
    assert second.prompt_ids[: len(first.prompt_ids) + len(first.output_ids)] == first.prompt_ids + first.output_ids
    assert sample.tokens == second.prompt_ids + second.output_ids


def test_a_client_that_leaves_mid_stream_records_nothing(tiny_ckpt):
    """The client closes the stream after its first content chunk: the generation is closed before its end, no
    turn is recorded, and the agent's retry continues the session's chain as if the stream had never been."""
    tok = load_tokenizer(tiny_ckpt)
    engine = StepEngine(tok)
    with serving(AgentProxy(engine, tok)) as p:
        client = _client(p, "D")
        messages = [{"role": "user", "content": "add one and ten"}]
        r1 = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        (call,) = r1.choices[0].message.tool_calls
        messages += [
            r1.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "11"},
        ]
        engine.gate_at = 4
        leaving = _client(p, "D")  # a connection of its own, closed by leaving
        stream = leaving.chat.completions.create(model="policy", messages=messages, tools=TOOLS, stream=True)
        for chunk in stream:
            if chunk.choices[0].delta.content:
                break
        stream.close()
        # The proxy finds the client gone at a write: of a chunk before the gate (the client closed before the proxy
        # wrote them all, seen under load), or, once the gate lets the generation go on, of one of the chunks after
        # it (the reply has 5 more before its last; aiohttp refuses the write after the one the kernel failed).
        engine.gate.set()
        deadline = time.monotonic() + 30
        while len(engine.stopped_at) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        steps, total = engine.stopped_at[-1]
        assert len(engine.stopped_at) == 2 and steps < total  # the leaving stream's generation closed before its end
        assert len(p.sessions[named(p, "D")].turns) == 1  # only the first request's
        engine.gate_at = None
        r2 = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    assert r2.choices[0].message.content == "it is 11"
    (sample,) = p.samples(named(p, "D"))
    first, retry = p.sessions[named(p, "D")].turns
    assert sample.tokens == retry.prompt_ids + retry.output_ids
    assert retry.prompt_ids[: len(first.prompt_ids) + len(first.output_ids)] == first.prompt_ids + first.output_ids


async def streaming_agent(base_url, sample, api_key):
    """Streams its first request and lets the engine go on once a content chunk came: the rollout streams too."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    stream = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "add"}], tools=TOOLS, stream=True
    )
    async for chunk in stream:
        if chunk.choices[0].delta.content:
            sample.metadata["gate"].set()


def test_the_rollout_engine_streams_through_agent_rollout(tiny_ckpt):
    import argparse

    from lichen.rollout import agent_rollout
    from lichen.rollout.custom_generate import run_custom_generate
    from lichen.types import Sample

    tok = load_tokenizer(tiny_ckpt)
    engine = StepEngine(tok, gate_at=3)
    args = argparse.Namespace(
        tool_paths=None,
        max_turns=8,
        tool_timeout=30.0,
        tool_call_parser="hermes",
        check_token_fidelity=False,
        agent_function_path="test_agent_proxy_stream.streaming_agent",
    )
    sample = Sample(prompt="add", tokens=[1], index=0, metadata={"gate": engine.gate})
    params = [{"max_new_tokens": 300, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "sampling_seed": 5}]
    ((s,),) = run_custom_generate(agent_rollout.generate, args, [sample], params, engine=engine, tokenizer=tok)
    assert engine.stopped_at == [(len(engine.reply([])), len(engine.reply([])))]
    assert s.tokens[len(s.tokens) - s.response_length :] == engine.reply([])


def test_a_client_that_leaves_before_a_plain_reply_records_nothing(tiny_ckpt):
    """The same rule without streaming: a reply whose client closed the connection while it was generated is
    not recorded (the agent never got it; its retry must find the session as it was)."""
    tok = load_tokenizer(tiny_ckpt)
    engine = StepEngine(tok, gate_at=2)
    with serving(AgentProxy(engine, tok)) as p:
        body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "add one and ten"}]}).encode()
        host, port = p.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            conn.sendall(
                b"POST /sessions/%s/v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (named(p, "P").encode(), p.api_key.encode(), len(body), body)
            )
            assert engine.started.wait(30)  # the request is being generated
        deadline = time.monotonic() + 30
        while not _lost(p) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _lost(p), "the proxy never saw the client go"
        engine.gate.set()
        _wait_handled(p)
        assert engine.stopped_at[0][0] == engine.stopped_at[0][1]  # generated to its end
        assert p.samples(named(p, "P")) == [] and p.sessions[named(p, "P")].turns == []


def test_the_engine_client_reads_long_events_and_error_events():
    """EngineClient.generate_stream (RemoteEngines' stream): an event longer than aiohttp's line limit, sent in
    pieces, arrives whole; an error event after it is an EngineRequestError with its code and message."""
    from aiohttp import web

    from lichen.engines.clients.client import EngineClient, EngineRequestError

    big = {"text": "x" * 700_000, "meta_info": {"finish_reason": None}}  # over the 512 KiB line limit

    async def generate(request):
        assert (await request.json())["stream"] is True
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        data = b"data: " + json.dumps(big).encode() + b"\n\n"
        for k in range(0, len(data), 100_000):
            await resp.write(data[k : k + 100_000])
        await resp.write(b'data: {"error": {"message": "engine fell over", "code": 503}}\n\ndata: [DONE]\n\n')
        return resp

    async def main():
        app = web.Application()
        app.router.add_post("/generate", generate)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        client = EngineClient(f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        got = []
        try:
            with pytest.raises(EngineRequestError, match="engine fell over") as e:
                async for out in client.generate_stream({"input_ids": [1]}):
                    got.append(out)
        finally:
            await client.close()
            await runner.cleanup()
        return got, e.value.status, client.outstanding

    assert asyncio.run(main()) == ([big], 503, 0)


def test_a_streamed_turn_is_recorded_before_the_stream_ends(tiny_ckpt, monkeypatch):
    """An agent sends its next request as soon as a stream ends, and that request reuses the turn's tokens only if
    the turn is recorded by then. The proxy's write of [DONE] is held here until the client has looked."""
    import httpx
    from aiohttp import web

    looked = threading.Event()
    write = web.StreamResponse.write

    async def held_write(self, data):
        await write(self, data)
        if data == b"data: [DONE]\n\n":
            await asyncio.to_thread(looked.wait, 30)

    monkeypatch.setattr(web.StreamResponse, "write", held_write)
    tok = load_tokenizer(tiny_ckpt)
    with serving(AgentProxy(StepEngine(tok), tok)) as p:
        body = {"model": "policy", "messages": [{"role": "user", "content": "add one and ten"}], "stream": True}
        url, key = p.session_url(named(p, "R")) + "/chat/completions", {"Authorization": f"Bearer {p.api_key}"}
        with httpx.stream("POST", url, json=body, headers=key, timeout=60) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    break
            recorded = len(p.sessions[named(p, "R")].turns)
            looked.set()
    assert recorded == 1


class Spy:
    """An in-process engine that keeps each batch's results: those of a closed stream, which its reader never sees."""

    def __init__(self, engine: Engine):
        self.engine, self.batches = engine, []

    def generate(self, requests: list[GenRequest], on_step=None) -> list[GenResult]:
        out = self.engine.generate(requests, on_step=on_step)
        self.batches.append(out)
        return out


def test_closing_a_stream_stops_its_row_in_process_and_the_batch_goes_on(tiny_ckpt):
    """BatchingEngine: a stream closed after two steps stops its generation at the engine's next step (finish
    "abort", its partial output); the other request of the same batch runs to its length, and a stream read to its
    end is unaffected."""
    engine = Engine.from_pretrained(tiny_ckpt)
    spy = Spy(engine)
    be, batches = BatchingEngine(spy), spy.batches
    long = {"max_new_tokens": 120, "ignore_eos": True, "seed": 3}

    async def main():
        other = asyncio.ensure_future(be.agenerate(GenRequest(input_ids=[5, 6, 7, 8], **long)))
        async with contextlib.aclosing(be.agenerate_stream(GenRequest(input_ids=[5, 6, 7], **long))) as stream:
            steps = 0
            async for _ in stream:
                steps += 1
                if steps == 2:
                    break
        full = await other
        whole = [r async for r in be.agenerate_stream(GenRequest(input_ids=[5, 6], **long))]
        return full, whole

    full, whole = asyncio.run(main())
    assert len(batches[0]) == 2  # the stream and the other request shared a batch
    stopped = batches[0][0]
    assert stopped.finish_reason == "abort" and 2 <= len(stopped.output_ids) < 120
    assert full.finish_reason == "length" and len(full.output_ids) == 120
    assert full.output_ids == engine.generate([GenRequest(input_ids=[5, 6, 7, 8], **long)])[0].output_ids
    assert whole[-1].finish_reason == "length" and len(whole[-1].output_ids) == 120


def test_a_stream_left_before_its_row_started_never_starts(tiny_ckpt):
    """With one decode slot the stream waits behind another request; its reader is cancelled meanwhile, so the
    engine drops it from the waiting line (finish "abort", no output) instead of generating it afterwards."""
    engine = Engine.from_pretrained(tiny_ckpt)
    engine.max_batch_size = 1
    spy = Spy(engine)
    be, batches = BatchingEngine(spy), spy.batches
    long = {"max_new_tokens": 60, "ignore_eos": True, "seed": 3}

    async def read(stream):
        async with contextlib.aclosing(stream) as s:
            return [r async for r in s]

    async def main():
        first = asyncio.ensure_future(be.agenerate(GenRequest(input_ids=[5, 6, 7, 8], **long)))
        reader = asyncio.ensure_future(read(be.agenerate_stream(GenRequest(input_ids=[5, 6, 7], **long))))
        for _ in range(3):
            await asyncio.sleep(0)
        reader.cancel()
        return await first

    first = asyncio.run(main())
    assert first.finish_reason == "length" and len(first.output_ids) == 60
    [[_, waiting]] = batches
    assert waiting.finish_reason == "abort" and waiting.output_ids == []
