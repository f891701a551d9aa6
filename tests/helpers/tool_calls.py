"""Tool calls on `lichen serve`'s OpenAI endpoint with scripted engine output (shared by the tool-call tests): a
real LichenServer on a loopback port whose jobs produce a given reply, the `scripted` fixture that starts them,
and the tool schema, call and messages the tests send."""

from __future__ import annotations

import asyncio
import threading

import openai
import pytest

from lichen.engines.api.tool_parsers import load_parser

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a+b",
            "parameters": {"type": "object", "properties": {"a": {}, "b": {}}},
        },
    }
]


class ScriptedServer:
    """A real LichenServer on a loopback port whose jobs produce `reply` (tokens + EOS) instead of sampling, so the
    route, the SDK and the parser see a model that calls tools."""

    def __init__(self, ckpt: str, reply: str, parser: str = "hermes", template: str | None = None):
        import torch

        from lichen.engines.core.engine import Engine
        from lichen.engines.server.http_server import LichenServer
        from lichen.models import load_model
        from lichen.models.tokenizer import eos_token_ids, load_tokenizer

        tok = load_tokenizer(ckpt)
        if template is not None:
            tok.chat_template = template
        eos = eos_token_ids(tok, ckpt)
        engine = Engine(load_model(ckpt, dtype=torch.float32), eos_token_ids=eos, pad_token_id=0)
        self.ids = list(tok.encode(reply, add_special_tokens=False)) + [eos[0]]
        self.prompts: list[list[int]] = []
        outer = self

        class Server(LichenServer):
            def _fill(self, job, n):
                job.seq.append(outer.ids[n], -0.01 * (n + 1), "v0")

            async def run_jobs(self, jobs, *, bounded=True):
                for job in jobs:
                    outer.prompts.append(list(job.seq.input_ids))
                    for n in range(len(outer.ids)):
                        self._fill(job, n)
                    job.seq.finish = ("stop", eos[0])

            async def stream_jobs(self, jobs):
                for job in jobs:
                    for n in range(len(outer.ids)):
                        self._fill(job, n)
                        yield job, n + 1
                    job.seq.finish = ("stop", eos[0])
                    yield job, None

        self.server = Server(engine, tok, model_path=ckpt, served_model_name="tiny", tool_parser=load_parser(parser))
        self.tok = tok
        started = threading.Event()
        self.loop = asyncio.new_event_loop()

        async def up():
            from aiohttp import web

            await self.server.start()
            self.runner = web.AppRunner(self.server.app())
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]
            started.set()

        self.thread = threading.Thread(
            target=lambda: (self.loop.run_until_complete(up()), self.loop.run_forever()), daemon=True
        )
        self.thread.start()
        assert started.wait(60)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0)

    def close(self):
        async def down():
            await self.runner.cleanup()
            await self.server.stop()

        asyncio.run_coroutine_threadsafe(down(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


@pytest.fixture
def scripted(tiny_ckpt):
    servers = []

    def make(reply, **kw):
        servers.append(ScriptedServer(tiny_ckpt, reply, **kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


MSGS = [{"role": "user", "content": "what is 1+2?"}]
