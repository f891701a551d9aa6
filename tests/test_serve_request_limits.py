"""`lichen serve` bounds the work of a request before it does it (issue 33 item 3) and answers /ready and /metrics.

Bodies over --max-request-bytes are refused (413) before they are read, bodies that do not arrive within
--body-timeout are cut off (408), counts and lengths are checked before anything is tokenized, and JSON decoding,
chat templating and tokenizing run off the event loop: a tokenizer held by a test (an event, not a clock) must not
stop /health from answering. The CLI server checks the flags end to end; the in-process one (the same
LichenServer and app over real loopback HTTP) lets the test hold and count its tokenizer.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
from typing import Any

import pytest
from aiohttp import web
from helpers.serve_process import call, launch

from lichen.engines.server.limits import BoundedAppRunner, Limits

GEN = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}


# ---- the CLI server: body size, body timeout, /ready, /metrics ------------------------------------------------
@pytest.fixture(scope="module")
def cli(tiny_ckpt, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("limits") / "serve.log")
    server = launch(
        tiny_ckpt, "--num-threads", "1", "--max-request-bytes", "100000", "--body-timeout", "1", log_path=log
    )
    yield server
    server.stop()


def raw_exchange(port: int, head: bytes, body: bytes = b"") -> bytes:
    """Send `head` (and `body`), then read until the server closes the connection (30 s bound)."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(30)
        s.sendall(head + body)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


@pytest.mark.slow
def test_an_oversized_body_is_refused_before_it_is_sent(cli):
    # the headers announce 1 GB and no byte of it is ever sent: only a check of Content-Length can answer
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n"
    reply = raw_exchange(cli.port, head)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"--max-request-bytes" in reply
    assert call(cli.url + "/generate", GEN)[0] == 200


def test_a_chunked_body_is_cut_off_at_the_cap(cli):
    chunk = b"x" * 8192
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(20)) + b"0\r\n\r\n"  # 160 kB > 100 kB
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    reply = raw_exchange(cli.port, head, body)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]


@pytest.mark.slow
def test_a_slow_body_is_cut_off(cli):
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    reply = raw_exchange(cli.port, head, b'{"input_ids"')  # 12 of 100 bytes, then nothing
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"--body-timeout" in reply
    assert call(cli.url + "/generate", GEN)[0] == 200


def metric(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        m = re.fullmatch(r"([^{ ]+)(?:\{(.*)\})? (\S+)", line)
        if m and m.group(1) == name:
            have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
            if all(have.get(k) == v for k, v in labels.items()):
                return float(m.group(3))
    return None


@pytest.mark.slow
def test_ready_and_metrics_answer_as_documented(cli):
    st, out = call(cli.url + "/ready")
    assert st == 200 and out["ready"] is True and out["paused"] is False
    assert call(cli.url + "/pause_generation", {"mode": "abort"})[0] == 200
    try:  # paused: requests are still taken (they wait), so the server is ready
        st, out = call(cli.url + "/ready")
        assert st == 200 and out["paused"] is True
    finally:
        call(cli.url + "/continue_generation", {})
    assert call(cli.url + "/release_memory_occupation", {})[0] == 200
    try:
        st, out = call(cli.url + "/ready")
        assert st == 503 and out["ready"] is False and "released" in out["status"]
    finally:
        assert call(cli.url + "/resume_memory_occupation", {})[0] == 200
    raw_exchange(cli.port, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n")
    assert call(cli.url + "/generate", GEN)[0] == 200
    import urllib.request

    with urllib.request.urlopen(cli.url + "/metrics", timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    assert "# TYPE sglang:num_running_reqs gauge" in text
    assert metric(text, "lichen:requests_refused_total", status="413") >= 1
    assert metric(text, "sglang:generation_tokens_total") >= 2
    assert metric(text, "lichen:ready") == 1.0
    assert metric(text, "lichen:weight_version_info", version="default") == 1.0


# ---- in process: a tokenizer the test holds and counts ---------------------------------------------------------
class HeldTokenizer:
    """The real tokenizer, counting encode / apply_chat_template calls; when `hold` is set, a call signals
    `entered` and waits for `release`."""

    def __init__(self, tok: Any):
        self._tok = tok
        self.calls = 0
        self.hold = False
        self.entered, self.release = threading.Event(), threading.Event()

    def _gate(self) -> None:
        self.calls += 1
        if self.hold:
            self.entered.set()
            assert self.release.wait(120), "the test never released the tokenizer"

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self._gate()
        return self._tok.encode(*args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self._gate()
        return self._tok.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


class InProcess:
    """A LichenServer and its app (with lichen serve's runner) on a loop in a thread, on a free loopback port."""

    def __init__(self, model: str, tok: HeldTokenizer, limits: Limits):
        from lichen.engines.core.engine import Engine
        from lichen.engines.server.http_server import LichenServer
        from lichen.models import load_model
        from lichen.models.tokenizer import eos_token_ids

        engine = Engine(load_model(model), eos_token_ids=eos_token_ids(tok._tok, model))
        self.server = LichenServer(engine, tok, model_path=model, limits=limits)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(60)
        self.url = f"http://127.0.0.1:{self.port}"

    async def _start(self) -> int:
        await self.server.start()
        self.runner = BoundedAppRunner(
            self.server.app(), header_timeout=20, access_log=None, handle_signals=False, handler_cancellation=True
        )
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        await self.server.stop()
        await self.runner.cleanup()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(60)


@pytest.fixture(scope="module")
def held(tiny_ckpt):
    from lichen.models.tokenizer import load_tokenizer

    tok = HeldTokenizer(load_tokenizer(tiny_ckpt))
    srv = InProcess(tiny_ckpt, tok, Limits(max_request_sequences=16))
    yield srv, tok
    tok.release.set()
    srv.stop()


PROMPT = "one two three " * 20
HELD_REQUESTS = {
    "generate": ("/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 1}}),
    "completions": ("/v1/completions", {"model": "m", "prompt": [PROMPT, PROMPT], "max_tokens": 1}),
    "chat": (
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1},
    ),
}


@pytest.mark.parametrize("what", sorted(HELD_REQUESTS))
def test_health_answers_while_a_request_is_being_tokenized(held, what):
    srv, tok = held
    path, body = HELD_REQUESTS[what]
    tok.entered.clear()
    tok.release.clear()
    tok.hold = True
    out: list = []
    t = threading.Thread(target=lambda: out.append(call(srv.url + path, body, timeout=120)))
    t.start()
    try:
        assert tok.entered.wait(60), "the request never reached the tokenizer"
        # the tokenizer is held inside this request's parsing: on the event loop, /health could not answer
        assert call(srv.url + "/health", timeout=30)[0] == 200
        assert call(srv.url + "/v1/loads?include=core", timeout=30)[0] == 200
    finally:
        tok.hold = False
        tok.release.set()
        t.join(120)
    assert out and out[0][0] == 200, out


def test_counts_and_lengths_are_checked_before_anything_is_tokenized(held):
    srv, tok = held
    ctx, most = srv.server.facts.context_length, srv.server.facts.max_text_chars
    assert most is not None and most >= ctx
    before = tok.calls
    st, out = call(srv.url + "/generate", {"text": ["a b"] * 17, "sampling_params": {"max_new_tokens": 1}})
    assert st == 400 and "more than 16 sequences" in out["error"]["message"]
    st, out = call(srv.url + "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1, "n": 17}})
    assert st == 400 and "more than 16 sequences" in out["error"]["message"]
    st, out = call(srv.url + "/v1/completions", {"model": "m", "prompt": ["a"] * 9, "max_tokens": 1, "n": 2})
    assert st == 400 and "more than 16 sequences" in out["message"]
    st, out = call(srv.url + "/generate", {"text": "x" * (most + 1), "sampling_params": {"max_new_tokens": 1}})
    assert st == 400 and f"more than fit in the context of {ctx} tokens" in out["message"]
    st, out = call(srv.url + "/v1/completions", {"model": "m", "prompt": ["ok", "x" * (most + 1)], "max_tokens": 1})
    assert st == 400 and "prompt[1] has" in out["message"]
    many = [{"role": "user", "content": "x" * (most // 4 + 1)}] * 4
    st, out = call(srv.url + "/v1/chat/completions", {"model": "m", "messages": many, "max_tokens": 1})
    assert st == 400 and "messages (their content together)" in out["message"]
    assert tok.calls == before  # none of them reached the tokenizer or the template
    # a text just inside the bound is tokenized and refused by its token count as before
    st, out = call(srv.url + "/generate", {"text": "x" * most, "sampling_params": {"max_new_tokens": 1}})
    assert st == 400 and tok.calls == before + 1


def test_launched_engines_get_a_body_cap_sized_from_the_run():
    from types import SimpleNamespace

    from lichen.engines.clients.launch_args import MIN_REQUEST_BYTES, launch_limits

    def flags(prompt: int | None, response: int | None) -> dict:
        cfg = SimpleNamespace(concurrency=8, max_prompt_len=prompt, max_response_len=response)
        out = launch_limits(cfg)
        return dict(zip(out[::2], out[1::2]))

    assert flags(100, 200)["--max-request-bytes"] == str(MIN_REQUEST_BYTES)
    assert flags(100_000, 31_072)["--max-request-bytes"] == str(64 * 131_072)
    assert "--max-request-bytes" not in flags(None, 200)  # lichen serve's default then
