"""The agent proxy (lichen/rollout/agent_proxy.py): two concurrent `openai`-SDK agents, one keyed by its base URL
and one by a header, each calling a tool and answering; each session becomes one Sample whose policy tokens are
exactly the engine's, with the tool turn masked, and the sessions stay apart."""

from __future__ import annotations

import threading

import openai
import pytest
from helpers.agent_proxy import TOOLS, ScriptedEngine, agent, agent_args, agent_training_run, client, named, serving

from lichen.models.tokenizer import load_tokenizer
from lichen.rollout.agent_proxy import AgentProxy
from lichen.types import Status


@pytest.fixture
def proxy(tiny_ckpt):
    tok = load_tokenizer(tiny_ckpt)
    engine = ScriptedEngine(tok)
    with serving(AgentProxy(engine, tok)) as p:
        yield p, engine, tok


def test_two_concurrent_sdk_sessions_become_two_samples(proxy):
    """Session A by its base URL, B by the header and streaming."""
    p, engine, tok = proxy
    a, b = named(p, "A"), named(p, "B")
    by_url = client(p, "A")
    by_header = openai.OpenAI(
        base_url=p.url + "/v1", api_key=p.api_key, max_retries=0, default_headers={"X-Session-Id": b}
    )
    out: dict = {}
    threads = [
        threading.Thread(target=agent, args=(by_url, "one", out)),
        threading.Thread(target=agent, args=(by_header, "two", out, True)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out == {"one": ("tool_calls", "it is 11"), "two": ("tool_calls", "it is 12")}
    for sid, result in ((a, "11"), (b, "12")):
        (sample,) = p.samples(sid)
        (_, in1, out1), (_, in2, out2) = [c for c in engine.calls if c[0] == sid]
        # the second request continued the first one's exact tokens; only the tool turn is new
        assert in2[: len(in1) + len(out1)] == in1 + out1
        tool = in2[len(in1) + len(out1) :]
        assert tok.decode(tool) == f"\n<|im_start|>tool\n{result}<|im_end|>\n<|im_start|>assistant\n"
        assert sample.tokens == in1 + out1 + tool + out2
        assert sample.response_length == len(out1 + tool + out2)
        assert sample.loss_mask == [1] * len(out1) + [0] * len(tool) + [1] * len(out2)
        assert sample.rollout_log_probs == pytest.approx(
            [-0.5 - 0.01 * k for k in range(len(out1))]
            + [0.0] * len(tool)
            + [-0.5 - 0.01 * k for k in range(len(out2))]
        )
        assert sample.status == Status.COMPLETED and sample.weight_versions == ["3"]
        assert sample.metadata["session"] == sid and f"it is {result}" in sample.response


def test_a_request_without_a_session_is_refused(proxy):
    p, _, _ = proxy
    no_session = openai.OpenAI(base_url=p.url + "/v1", api_key=p.api_key, max_retries=0)
    with pytest.raises(openai.NotFoundError, match="X-Session-Id"):
        no_session.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    assert p.samples("nobody") == [] and p.refused == 1


@pytest.mark.parametrize(
    "choice, named",
    [("required", 'tool_choice "required"'), ({"type": "function", "function": {"name": "add"}}, '"name": "add"')],
)
def test_tool_choice_is_taken_as_lichen_serve_takes_it(proxy, choice, named):
    """A forced call is refused with a 400 naming the value (never answered as "auto"), and nothing is recorded;
    "none" does not show the model the tools and parses no call."""
    p, engine, tok = proxy
    sid = p.open_session()
    c = openai.OpenAI(base_url=p.session_url(sid), api_key=p.api_key, max_retries=0)
    messages = [{"role": "user", "content": "what is 5 + 10?"}]
    with pytest.raises(openai.BadRequestError, match="is not supported") as e:
        c.chat.completions.create(model="policy", messages=messages, tools=TOOLS, tool_choice=choice)
    assert named in str(e.value) and p.samples(sid) == []
    r = c.chat.completions.create(model="policy", messages=messages, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content
    assert '"name": "add"' not in tok.decode(engine.calls[-1][1])  # the prompt showed no tools


# ---- --agent-function-path: the proxy as the rollout's generate function ------------------------------------------
async def silent_agent(base_url, sample, api_key):
    return None


def test_agent_function_is_a_generate_function(tiny_ckpt):

    from lichen.engines.core.sampler import derive_seed
    from lichen.rollout import agent_rollout
    from lichen.rollout.custom_generate import run_custom_generate
    from lichen.types import Sample

    tok = load_tokenizer(tiny_ckpt)
    engine = ScriptedEngine(tok)
    requests = engine.requests
    args = agent_args("helpers.agent_proxy.sdk_agent")
    samples = [
        Sample(prompt=f"add {w} and ten", tokens=[1], label=w, index=i, metadata={"k": i})
        for i, w in enumerate(("one", "two"))
    ]
    params = [
        {"max_new_tokens": 300, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "sampling_seed": 40 + i}
        for i in range(2)
    ]
    outs = run_custom_generate(agent_rollout.generate, args, samples, params, engine=engine, tokenizer=tok)
    for i, (out, result) in enumerate(zip(outs, ("11", "12"))):
        (s,) = out
        assert s.status == Status.COMPLETED and f"it is {result}" in s.response
        assert s.label == ("one", "two")[i] and s.metadata["k"] == i and s.index == i
        assert s.loss_mask.count(0) == len(
            tok.encode(f"\n<|im_start|>tool\n{result}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
        )
    # the rollout's sampling settings, one seed per request, the budget capped: not what the agent asked for
    mine = sorted((r for r in requests), key=lambda r: r.seed)
    assert {r.seed for r in mine} == {40, 41, derive_seed(40, 1), derive_seed(41, 1)}
    assert all(r.temperature == 0.7 and r.top_p == 0.9 and r.max_new_tokens == 300 for r in mine)
    args.agent_function_path = "test_agent_proxy.silent_agent"
    (out,) = run_custom_generate(agent_rollout.generate, args, samples[:1], params[:1], engine=engine, tokenizer=tok)
    assert out[0].status == Status.FAILED and out[0].metadata["agent"] == "no request"


def test_training_step_through_the_agent_proxy(tiny_ckpt, addition_data, tmp_path, monkeypatch):
    """A training step whose samples come from an openai-SDK agent: the trained tokens are the engine's plus the
    template's tool turn, the mask is exact and the rollout log-probs match the trainer's."""

    rows, samples, returned, _ = agent_training_run(
        tiny_ckpt, addition_data, tmp_path, monkeypatch, "helpers.agent_proxy.add_agent"
    )
    assert len(samples) == 16 and len(returned) == 32
    outputs = {tuple(inp): ids for inp, ids in returned}
    for s in samples:
        prompt = s["tokens"][: len(s["tokens"]) - s["response_length"]]
        turn1 = outputs[tuple(prompt)]
        (inp2,) = [inp for inp in outputs if len(inp) > len(prompt) and list(inp[: len(prompt)]) == prompt]
        tool = list(inp2[len(prompt) + len(turn1) :])
        assert list(inp2[: len(prompt) + len(turn1)]) == prompt + turn1
        assert s["tokens"] == prompt + turn1 + tool + outputs[inp2]
        assert s["loss_mask"] == [1] * len(turn1) + [0] * len(tool) + [1] * len(outputs[inp2])
    assert rows[0]["train/train_rollout_logprob_abs_diff"] <= 1e-5
