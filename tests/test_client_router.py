"""The engine HTTP client and router (lichen/engines/clients/client.py, router.py).

Client behaviour (retries, concurrency cap, API key) is checked against small aiohttp servers run in the test,
whose handlers count what really reached them; the protocol translation against one real `lichen serve` with
--api-key, compared with the in-process engine on the same seeds.
"""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from helpers.batch_schedule import assert_mostly_same_generations
from helpers.serve_process import launch

from lichen.engines.clients.client import (
    EngineClient,
    EngineError,
    EngineRequestError,
    EngineUnavailable,
    generate_payload,
    normalize_url,
    result_from_output,
)
from lichen.engines.clients.router import NoEngineAvailable, Router
from lichen.engines.core.engine import Engine, GenRequest
from lichen.engines.core.sampler import derive_seed

KEY = "sekrit-key"


# ---- helpers ------------------------------------------------------------------------------------------------
async def start_app(routes: list[web.RouteDef]) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def answer(tokens=(5, 6), version="3", finish="length") -> dict:
    return {
        "text": "",
        "output_ids": list(tokens),
        "meta_info": {
            "id": "x",
            "finish_reason": {"type": finish},
            "prompt_tokens": 2,
            "completion_tokens": len(tokens),
            "weight_version": version,
            "output_token_logprobs": [[-0.5 * (i + 1), t, None] for i, t in enumerate(tokens)],
        },
    }


# ---- protocol translation ---------------------------------------------------------------------------------
def test_payload_and_result_translation():
    req = GenRequest(
        input_ids=[3, 4],
        max_new_tokens=7,
        temperature=-1.0,
        top_p=0.9,
        top_k=5,
        stop_token_ids=[9],
        seed=123,
        ignore_eos=True,
    )
    body = generate_payload(req, rid="r1")
    sp = body["sampling_params"]
    assert body["input_ids"] == [3, 4] and body["return_logprob"] is True and body["rid"] == "r1"
    assert sp["temperature"] == 0.0 and sp["top_p"] == 0.9 and sp["top_k"] == 5 and sp["max_new_tokens"] == 7
    assert sp["sampling_seed"] == 123 and sp["stop_token_ids"] == [9] and sp["ignore_eos"] is True
    assert sp["no_stop_trim"] is True  # EOS / stop tokens stay in the output, as in process

    res = result_from_output(answer((5, 6), "3", "stop"))
    assert res.output_ids == [5, 6] and res.output_logprobs == [-0.5, -1.0]
    assert (res.finish_reason, res.prompt_tokens, res.weight_version) == ("stop", 2, "3")
    broken = answer()
    del broken["meta_info"]["output_token_logprobs"]
    with pytest.raises(EngineError, match="output_token_logprobs"):
        result_from_output(broken, "http://h:1")
    assert normalize_url("127.0.0.1:30000") == "http://127.0.0.1:30000"
    assert normalize_url("https://h:1/") == "https://h:1"


# ---- retries, cap, key (fake servers) ---------------------------------------------------------------------
def test_connection_errors_are_retried_then_reported():
    calls = []

    async def flaky(request: web.Request) -> web.Response:
        calls.append(request.headers.get("Authorization"))
        if len(calls) <= 2:  # drop the connection without an answer, as a dying server would
            request.transport.close()
            return web.Response()
        return web.json_response(answer())

    async def main():
        runner, url = await start_app([web.post("/generate", flaky)])
        try:
            client = EngineClient(url, api_key=KEY, max_retries=3, retry_delay=0.01)
            out = await client.generate({"input_ids": [1]})
            attempts = client.attempts
            await client.close()
            few = EngineClient(url, max_retries=1, retry_delay=0.01)
            calls.clear()
            with pytest.raises(EngineUnavailable, match="2 attempt"):
                await few.generate({"input_ids": [1]})
            await few.close()
        finally:
            await runner.cleanup()
        dead = EngineClient(url, max_retries=2, retry_delay=0.01)  # nothing listens there any more
        with pytest.raises(EngineUnavailable, match=url):
            await dead.generate({"input_ids": [1]})
        assert dead.attempts == 3
        await dead.close()
        return out, attempts

    out, attempts = asyncio.run(main())
    assert result_from_output(out).output_ids == [5, 6]
    assert attempts == 3
    assert calls == [None, None]  # the key is sent only when given


def test_concurrency_cap_bounds_requests_in_flight_per_engine():
    state = {"now": 0, "max": 0, "total": 0}

    async def slow(request: web.Request) -> web.Response:
        state["now"] += 1
        state["total"] += 1
        state["max"] = max(state["max"], state["now"])
        await asyncio.sleep(0.05)
        state["now"] -= 1
        return web.json_response(answer())

    async def main():
        runner, url = await start_app([web.post("/generate", slow)])
        try:
            client = EngineClient(url, concurrency=3)
            outs = await asyncio.gather(*[client.generate({"input_ids": [1]}) for _ in range(10)])
            await client.close()
        finally:
            await runner.cleanup()
        return outs

    assert len(asyncio.run(main())) == 10
    assert state["total"] == 10 and state["max"] == 3  # never more than the cap, and the cap is used


def test_http_errors_are_not_retried_and_name_the_server():
    hits = []

    async def bad(request: web.Request) -> web.Response:
        hits.append(1)
        return web.json_response({"error": {"message": "input_ids cannot be empty."}}, status=400)

    async def main():
        runner, url = await start_app([web.post("/generate", bad)])
        try:
            client = EngineClient(url, max_retries=3, retry_delay=0.01)
            with pytest.raises(EngineRequestError) as info:
                await client.generate({"input_ids": []})
            await client.close()
        finally:
            await runner.cleanup()
        return url, info.value

    url, err = asyncio.run(main())
    assert err.status == 400 and url in str(err) and "input_ids cannot be empty." in str(err)
    assert len(hits) == 1


# ---- router (stub engines) ---------------------------------------------------------------------------------
class StubEngine:
    """Counts outstanding requests like EngineClient; `hold` keeps requests open until released."""

    def __init__(self, name: str, hold: bool = False, down: bool = False):
        self.url, self.hold, self.down = f"http://{name}:1", hold, down
        self.outstanding = 0
        self.served: list[int] = []
        self.release = asyncio.Event()

    async def generate(self, payload: dict) -> dict:
        if self.down:
            raise EngineUnavailable(f"{self.url}/generate: connection refused")
        self.outstanding += 1
        try:
            if self.hold:
                await self.release.wait()
            self.served.append(payload["n"])
            return answer()
        finally:
            self.outstanding -= 1

    async def close(self) -> None:
        pass


def test_router_least_outstanding_with_round_robin_ties():
    async def main():
        a, b, c = StubEngine("a"), StubEngine("b"), StubEngine("c")
        router = Router([a, b, c])
        for n in range(6):  # idle engines: ties, so they take turns
            await router.generate({"n": n})
        assert (a.served, b.served, c.served) == ([0, 3], [1, 4], [2, 5])

        slow, fast = StubEngine("slow", hold=True), StubEngine("fast")
        router = Router([slow, fast])
        tasks = []
        for n in range(6):  # one at a time: `slow` keeps its first request open, so it stays the busier one
            tasks.append(asyncio.ensure_future(router.generate({"n": n})))
            await asyncio.sleep(0.01)
        assert slow.outstanding == 1 and fast.served == [1, 2, 3, 4, 5]
        slow.release.set()
        await asyncio.gather(*tasks)
        assert slow.served == [0] and router.routed == [1, 5]

    asyncio.run(main())


def test_a_burst_of_picks_counts_each_pick_at_once():
    # Requests picked in one burst, before any of their calls started running (a rollout submits a whole round at
    # once): each pick must count at once, or the burst sees the same stale loads and piles onto one engine.
    async def main():
        busy, idle = StubEngine("busy", hold=True), StubEngine("idle", hold=True)
        router = Router([busy, idle])
        first = asyncio.ensure_future(router.generate({"n": 0}))
        await asyncio.sleep(0.01)  # `busy` holds one request
        burst = [asyncio.ensure_future(router.generate({"n": n})) for n in range(1, 6)]
        await asyncio.sleep(0.01)
        # loads (1, 0) -> idle, then ties alternate: 2 more to busy, 3 to idle (counting only started calls: 0 and 5)
        assert (busy.outstanding, idle.outstanding) == (3, 3) and router.routed == [3, 3]
        busy.release.set()
        idle.release.set()
        await asyncio.gather(first, *burst)

    asyncio.run(main())


def test_router_session_affinity():
    async def main():
        engines = [StubEngine("a", hold=True), StubEngine("b", hold=True)]
        router = Router(engines)
        first = router.pick("conv-1")
        tasks = [asyncio.ensure_future(router.generate({"n": n}, session_id="conv-1")) for n in range(4)]
        await asyncio.sleep(0.01)
        # the session stays on its engine although the other one is idle
        assert engines[first].outstanding == 4 and engines[1 - first].outstanding == 0
        assert router.pick("conv-2") == 1 - first  # a new session goes to the less loaded engine
        assert router.pick("conv-2") == 1 - first
        router.remove(first)  # its engine leaves rotation: the session moves and sticks to the new one
        assert router.pick("conv-1") == 1 - first
        router.restore(first)
        assert router.pick("conv-1") == 1 - first
        for e in engines:
            e.release.set()
        await asyncio.gather(*tasks)
        router.end_session("conv-1")
        assert "conv-1" not in router.sessions

    asyncio.run(main())


def test_router_failover_resends_to_a_healthy_engine():
    async def main():
        dead, alive = StubEngine("dead", down=True), StubEngine("alive")
        strict = Router([dead, alive])
        with pytest.raises(EngineUnavailable):
            await strict.generate({"n": 0})  # without failover the error is the caller's
        router = Router([dead, alive], failover=True)
        index, out = await router.generate({"n": 1})
        assert index == 1 and alive.served == [1]
        assert router.reissued == 1 and router.in_rotation() == [1]
        alive.down = True
        with pytest.raises(NoEngineAvailable):
            await router.generate({"n": 2})

    asyncio.run(main())


# ---- a real `lichen serve` with an API key ------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed_server(tiny_ckpt, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    server = launch(tiny_ckpt, "--api-key", KEY, "--num-threads", "1", log_path=str(log))
    yield server
    server.stop()


@pytest.mark.slow
def test_real_server_key_endpoints_and_in_process_equality(keyed_server, tiny_ckpt):
    reqs = [
        GenRequest(input_ids=[5, 9, 14, 3], max_new_tokens=6, temperature=0.8, top_p=0.9, seed=derive_seed(1, 0, 0)),
        GenRequest(input_ids=[7, 2], max_new_tokens=5, temperature=0.0, seed=derive_seed(1, 0, 1)),
        GenRequest(input_ids=[11, 12, 13], max_new_tokens=6, temperature=1.0, top_k=4, seed=derive_seed(1, 0, 2)),
    ]

    async def main():
        anonymous = EngineClient(keyed_server.url, max_retries=0)
        assert await anonymous.healthy()  # health needs no key
        with pytest.raises(EngineRequestError) as info:
            await anonymous.generate(generate_payload(reqs[0]))
        assert info.value.status == 401
        await anonymous.close()
        client = EngineClient(keyed_server.url, api_key=KEY)
        outs = await asyncio.gather(*[client.generate(generate_payload(r)) for r in reqs])
        probes = {
            p: await client.has_endpoint(p)
            for p in ("/generate", "/update_weights_from_disk", "/release_memory_occupation", "/no_such")
        }
        version = await client.weight_version()
        await client.close()
        return outs, probes, version

    outs, probes, version = asyncio.run(main())
    assert probes == {
        "/generate": True,
        "/update_weights_from_disk": True,
        "/release_memory_occupation": True,
        "/no_such": False,
    }
    assert version == "default"
    remote = [result_from_output(o) for o in outs]
    local = Engine.from_pretrained(tiny_ckpt).generate(reqs)
    # the same per-request seed draws the same tokens (a server batch rounds like a local one but for rare flips)
    assert_mostly_same_generations(
        [(r.output_ids, r.output_logprobs, loc.output_ids, loc.output_logprobs) for r, loc in zip(remote, local)],
        max_flips=1,
    )
    for r, loc in zip(remote, local):
        assert (r.prompt_tokens, r.weight_version) == (loc.prompt_tokens, "default")
