"""Shared by the agent-proxy tests (tests/test_agent_proxy*.py): a scripted engine, the proxy served on a thread's
event loop, and `openai`-SDK agents that call the `add` tool."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import threading

import openai

from lichen.engines.core.engine import GenResult
from lichen.rollout.agent_proxy import AgentProxy

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]


class ScriptedEngine:
    """Calls `add` with the number the user gave, then answers with the tool's result. The call is preceded by
    `<|endoftext|>` spelled out in characters: text that re-encodes to other tokens (one special token), so only
    a proxy that keeps the engine's tokens continues the trajectory exactly."""

    def __init__(self, tok, spell_out: bool = True):
        self.tok, self.im_end = tok, tok.convert_tokens_to_ids("<|im_end|>")
        self.spell_out = spell_out  # False: every reply is the canonical encoding of its text
        self.calls: list[tuple[str, list[int], list[int]]] = []
        self.requests: list = []  # the GenRequests as the engine got them

    async def agenerate(self, r, session_id=None):
        self.requests.append(r)
        await asyncio.sleep(0.01)  # let the other session's request in between
        text = self.tok.decode(r.input_ids)
        n = 1 if "one" in text else 2
        if "<|im_start|>tool" in text:
            reply = "it is " + text.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0]
        else:
            reply = '<tool_call>{"name": "add", "arguments": {"a": ' + str(n) + ', "b": 10}}</tool_call>'
        ids = list(self.tok.encode(reply, add_special_tokens=False)) + [self.im_end]
        if self.spell_out and not reply.startswith("it is"):
            ids = [self.tok.convert_tokens_to_ids(c) for c in "<|endoftext|>"] + ids
        self.calls.append((session_id, list(r.input_ids), ids))
        return GenResult(ids, [-0.5 - 0.01 * k for k in range(len(ids))], "stop", len(r.input_ids), "3")


@contextlib.contextmanager
def serving(p: AgentProxy):
    """`p` started on an event loop of its own thread (the SDK's blocking client calls it from the test)."""
    loop = asyncio.new_event_loop()
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    asyncio.run_coroutine_threadsafe(p.start(), loop).result(30)
    try:
        yield p
    finally:
        asyncio.run_coroutine_threadsafe(p.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        th.join(30)


def agent(client: openai.OpenAI, number: str, out: dict, stream: bool = False) -> None:
    messages = [{"role": "user", "content": f"add {number} and ten"}]
    if stream:  # the SDK's streaming helper puts the chunks back together
        with client.chat.completions.stream(model="policy", messages=messages, tools=TOOLS) as events:
            r1 = events.get_final_completion()
    else:
        r1 = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    (call,) = r1.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    msg = r1.choices[0].message
    assistant = {
        "role": "assistant",
        "content": msg.content,
        "tool_calls": [c.model_dump(include={"id", "type", "function"}) for c in msg.tool_calls],
    }
    messages += [assistant, {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])}]
    r2 = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    out[number] = (r1.choices[0].finish_reason, r2.choices[0].message.content)


def named(p: AgentProxy, name: str) -> str:
    """The id of the session a test calls `name` (opened on first use: the proxy's ids are random)."""
    names = p.__dict__.setdefault("test_names", {})
    if name not in names:
        names[name] = p.open_session()
    return names[name]


def client(p: AgentProxy, name: str) -> openai.OpenAI:
    """A blocking SDK client of the session a test calls `name`, with the proxy's key."""
    return openai.OpenAI(base_url=p.session_url(named(p, name)), api_key=p.api_key, max_retries=0)


async def sdk_agent(base_url, sample, api_key):
    """An agent on the async SDK: asks, runs the tool itself, answers."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": sample.prompt}]
    r1 = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, temperature=0.0)
    (call,) = r1.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    messages += [
        r1.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])},
    ]
    await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=10**6)


async def add_agent(base_url, sample, api_key):
    """The agent of the agent-proxy training tests: calls `add` through the proxy, runs it, answers."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": sample.prompt}]
    r1 = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    (call,) = r1.choices[0].message.tool_calls
    messages += [
        r1.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "3"},
    ]
    await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)


def agent_args(path: str, **extra) -> argparse.Namespace:
    """The tool-use flags of a run through `--agent-function-path path` (as lichen.config.tools defines them)."""
    return argparse.Namespace(
        tool_paths=None,
        max_turns=8,
        tool_timeout=30.0,
        tool_call_parser="hermes",
        check_token_fidelity=False,
        agent_function_path=path,
        **extra,
    )


def agent_training_run(tiny_ckpt, data, tmp_path, monkeypatch, agent_path: str):
    """One `lichen train` step whose samples come from the agent `agent_path` over the in-process engine, scripted
    to call `add` and then answer "3": (metric rows, dumped samples, the engine's (input_ids, output_ids), tok)."""
    from helpers.runs import base_args, dumped_samples, run
    from helpers.scripted_policy import scripted_generate
    from lichen.engines.core.engine import Engine
    from lichen.models.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_ckpt)
    returned: list = []
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    monkeypatch.setattr(
        Engine, "generate", scripted_generate(tok, lambda text: "3" if "<|im_start|>tool" in text else call, returned)
    )
    dump = str(tmp_path / "r_{rollout_id}.pt")
    rows = run(
        base_args(
            tiny_ckpt,
            data,
            tmp_path / "o",
            "--num-rollout",
            "1",
            "--num-threads",
            "1",
            "--apply-chat-template",
            "--rollout-max-response-len",
            "120",
            "--agent-function-path",
            agent_path,
            "--save-debug-rollout-data",
            dump,
        )
    )
    return rows, dumped_samples(dump.format(rollout_id=0)), returned, tok
