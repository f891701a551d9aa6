"""The agent proxy as an attacker finds it (issue 33): every local user can reach its loopback port, so a request
without the proxy's key, with a wrong one, or to a session lichen did not open (a guessed id, a closed one) is
refused with an OpenAI-style JSON error, nothing of it reaches the engine or a Sample, and it is counted
(`proxy.refused`, `rollout/agent_proxy_refused` in a run's metrics). Malformed bodies are 400s naming the field,
checked as `lichen serve` checks them, never 500s; `max_tokens` is capped at the proxy's budget."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from helpers.agent_proxy import TOOLS, ScriptedEngine, add_agent, agent_args, agent_training_run, serving

from lichen.models.tokenizer import load_tokenizer
from lichen.rollout.agent_proxy import AgentProxy

HI = {"model": "policy", "messages": [{"role": "user", "content": "add one and ten"}]}


@pytest.fixture
def proxy(tiny_ckpt):
    tok = load_tokenizer(tiny_ckpt)
    engine = ScriptedEngine(tok)
    with serving(AgentProxy(engine, tok, max_new_tokens=64)) as p:
        yield p, engine


def _post(p: AgentProxy, sid: str, body, headers: dict | None = None) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    return httpx.post(p.session_url(sid) + "/chat/completions", content=data, headers=hdrs, timeout=60)


def _key(p: AgentProxy) -> dict:
    return {"Authorization": f"Bearer {p.api_key}"}


def _refused(r: httpx.Response, status: int, words: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]  # OpenAI's shape, which the SDK reads the message from
    assert words in err["message"] and err["code"] == status


def test_requests_without_the_key_are_refused_and_never_recorded(proxy):
    p, engine = proxy
    sid = p.open_session()
    _refused(_post(p, sid, HI), 401, "needs its key")
    _refused(_post(p, sid, HI, {"Authorization": "Bearer wrong"}), 401, "needs its key")
    _refused(_post(p, sid, HI, {"x-api-key": p.api_key[:-1]}), 401, "needs its key")
    _refused(_post(p, sid, HI, {"Authorization": "Bearer none"}), 401, "needs its key")  # the old docs' api_key
    # the SDK's client with a wrong key: AuthenticationError
    bad = openai.OpenAI(base_url=p.session_url(sid), api_key="none", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="needs its key"):
        bad.chat.completions.create(**HI)
    assert engine.calls == [] and p.samples(sid) == [] and p.refused == 5
    # the right key, either header, is served and recorded
    assert _post(p, sid, HI, {"x-api-key": p.api_key}).status_code == 200
    good = openai.OpenAI(base_url=p.session_url(sid), api_key=p.api_key, max_retries=0)
    assert good.chat.completions.create(**HI, tools=TOOLS).choices[0].finish_reason == "tool_calls"
    assert len(p.sessions[sid].turns) == 2 and p.refused == 5


def test_guessed_and_closed_sessions_are_refused_even_with_the_key(proxy):
    p, engine = proxy
    sid = p.open_session()
    assert len(sid) >= 22 and sid != p.open_session()  # 128 random bits each
    for guess in ("sample0", "sample1", "A", "traj-0"):  # what ids used to be
        _refused(_post(p, guess, HI, _key(p)), 404, "no live session")
    header = {**_key(p), "X-Session-Id": "sample0"}
    r = httpx.post(p.url + "/v1/chat/completions", json=HI, headers=header, timeout=60)
    _refused(r, 404, "no live session")
    r = httpx.post(p.url + "/v1/chat/completions", json=HI, headers=_key(p), timeout=60)
    _refused(r, 404, "no session")
    assert _post(p, sid, HI, _key(p)).status_code == 200
    p.close_session(sid)  # the trajectory ended: its id is old now
    _refused(_post(p, sid, HI, _key(p)), 404, "no live session")
    assert len(engine.calls) == 1 and len(p.sessions[sid].turns) == 1 and p.refused == 7
    assert not any(sid_ in p.sessions for sid_ in ("sample0", "sample1", "A", "traj-0"))


def test_unknown_paths_and_huge_bodies_answer_json(proxy):
    p, engine = proxy
    r = httpx.get(p.url + "/v1/models", headers=_key(p), timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = httpx.get(p.session_url(p.open_session()) + "/chat/completions", headers=_key(p), timeout=60)
    assert r.status_code == 405 and r.json()["error"]["code"] == 405
    _refused(httpx.get(p.url + "/anything", timeout=60), 401, "needs its key")  # the key comes first
    huge = {**HI, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    r = _post(p, p.open_session(), huge, _key(p))
    assert r.status_code == 413 and r.json()["error"]["code"] == 413 and engine.calls == []


@pytest.mark.parametrize(
    "body, words",
    [
        (b"{not json", "malformed JSON"),
        (b"", "body is empty"),
        (b'{"model": "policy", "messages": [], "temperature": NaN}', "NaN is not valid JSON"),
        (b"[1, 2]", "the request body must be a JSON object"),
        ({"model": "policy"}, "messages must be a list"),
        ({"model": "policy", "messages": "hi"}, "messages must be a list"),
        ({"model": "policy", "messages": []}, "messages cannot be empty"),
        ({"model": "policy", "messages": [1]}, "messages[0] must be an object"),
        ({"model": "policy", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"model": "policy", "messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
        ({**HI, "temperature": "hot"}, "request.temperature must be a number"),
        ({**HI, "temperature": -1}, "temperature must be non-negative"),
        ({**HI, "top_p": 0}, "top_p must be in (0, 1]"),
        ({**HI, "max_tokens": "many"}, "request.max_new_tokens must be an integer"),
        ({**HI, "max_tokens": -5}, "max_new_tokens must be at least 0"),
        ({**HI, "max_tokens": 0}, "max_tokens must be at least 1"),
        ({**HI, "n": "x"}, "request.n must be an integer"),
        ({**HI, "n": 0}, "n must be at least 1"),
        ({**HI, "n": 1000000}, "n must be 1 on the agent proxy"),
        ({**HI, "seed": 1.5}, "request.sampling_seed must be an integer"),
        ({**HI, "stream": "yes"}, "stream must be true or false"),
        ({**HI, "logprobs": 1}, "logprobs must be true or false"),
        ({**HI, "stop": ["x"]}, "stop strings are not supported"),
        ({**HI, "frequency_penalty": 1.0}, "is not supported"),
        ({**HI, "response_format": {"type": "json_object"}}, "response_format"),
        ({**HI, "tools": "add"}, "tools must be a list"),
        (
            {"model": "policy", "messages": [{"role": "assistant", "content": "", "tool_calls": [{"x": 1}]}]},
            "tool_calls[0] must have function.name",
        ),
    ],
)
def test_malformed_requests_are_400s_naming_the_field(proxy, body, words):
    p, engine = proxy
    sid = p.open_session()
    r = _post(p, sid, body, _key(p))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"] == "invalid_request_error"
    assert engine.calls == [] and p.samples(sid) == [] and p.refused == 0


def test_max_tokens_is_capped_at_the_proxy_budget(proxy):
    """A standalone proxy's `max_tokens` never passes its own budget (max_new_tokens=64 here)."""
    p, engine = proxy
    seen = engine.requests
    sid = p.open_session()
    for asked in (10**9, 5, None):
        body = {**HI, "temperature": 0.5, "seed": 3} | ({} if asked is None else {"max_tokens": asked})
        assert _post(p, sid, body, _key(p)).status_code == 200
    assert [r.max_new_tokens for r in seen] == [64, 5, 64]
    assert all(r.temperature == 0.5 and r.seed == 3 for r in seen)


# ---- a run: the attacker's requests during a trajectory are refused and counted in the metrics ----------------
async def attacked_agent(base_url, sample, api_key):
    """The test agent of test_agent_proxy, with an attacker posting to its proxy meanwhile: no key, a wrong key,
    and (with the key, so that only the session stands in the way) the session id the proxy used to give."""
    root = base_url.split("/sessions/")[0]
    attack = {"model": "policy", "messages": [{"role": "user", "content": "ATTACK"}]}
    async with httpx.AsyncClient(timeout=60) as h:
        codes = [
            (await h.post(base_url + "/chat/completions", json=attack)).status_code,
            (
                await h.post(base_url + "/chat/completions", json=attack, headers={"Authorization": "Bearer x"})
            ).status_code,
            (
                await h.post(
                    f"{root}/sessions/sample{sample.index}/v1/chat/completions",
                    json=attack,
                    headers={"Authorization": f"Bearer {api_key}"},
                )
            ).status_code,
        ]
    assert codes == [401, 401, 404], codes
    await add_agent(base_url, sample, api_key)


def test_attacks_during_a_run_are_refused_and_in_the_metrics(tiny_ckpt, addition_data, tmp_path, monkeypatch):
    agent = "test_agent_proxy_security.attacked_agent"
    rows, samples, returned, tok = agent_training_run(tiny_ckpt, addition_data, tmp_path, monkeypatch, agent)
    assert len(samples) == 16 and len(returned) == 32  # only the agents' own two requests each reached the engine
    assert not any("ATTACK" in tok.decode(inp) for inp, _ in returned)
    assert not any("ATTACK" in tok.decode(s["tokens"]) for s in samples)
    assert rows[0]["rollout/agent_proxy_refused"] == 3 * 16
    assert sum(s["metadata"]["agent_proxy_refused"] for s in samples) == 3 * 16


def test_an_agent_without_the_key_parameter_is_a_config_error(tmp_path):
    from lichen.config.tools import check
    from lichen.errors import ConfigError

    args = agent_args(
        "test_agent_proxy_security.keyless_agent", apply_chat_template=True, custom_generate_function_path=None
    )
    with pytest.raises(ConfigError, match="must take the agent proxy's key"):
        check(args)
    args.agent_function_path = "test_agent_proxy_security.attacked_agent"
    check(args)
    assert args.custom_generate_function_path == "lichen.rollout.agent_rollout.generate"


async def keyless_agent(base_url, sample):
    return None
