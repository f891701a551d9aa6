"""The token-fidelity check of agent-proxy sessions (AgentProxy(check_fidelity=True), --check-token-fidelity with
--agent-function-path): each Sample against apply_chat_template of its conversation, the first mismatch recorded as
the tool rollout records it."""

from __future__ import annotations

import argparse
import logging

import pytest
from helpers.agent_proxy import TOOLS, ScriptedEngine, agent, named, serving
from helpers.agent_proxy import client as _sdk

from lichen.models.tokenizer import load_tokenizer
from lichen.rollout.agent_proxy import AgentProxy


@pytest.mark.parametrize("spell_out", [False, True])
def test_sdk_session_with_tools(tiny_ckpt, spell_out, caplog):
    """Replies that are the canonical tokens of their text agree with the template everywhere; a turn whose tokens
    spell `<|endoftext|>` out in characters (re-tokenized: the template's text encodes it as one special token) is
    reported at its first token, with a warning."""
    tok = load_tokenizer(tiny_ckpt)
    engine = ScriptedEngine(tok, spell_out=spell_out)
    out: dict = {}
    with serving(AgentProxy(engine, tok, check_fidelity=True)) as p, caplog.at_level(logging.WARNING):
        agent(_sdk(p, "A"), "one", out)
    assert out == {"one": ("tool_calls", "it is 11")}
    (sample,) = p.samples(named(p, "A"))  # one chain: the second request continued the first one's tokens
    (_, in1, out1), _ = engine.calls
    if not spell_out:
        assert sample.metadata["token_fidelity"] is None and "agent proxy" not in caplog.text
        return
    assert sample.metadata["token_fidelity"] == {
        "position": len(in1),
        "trained": tok.convert_tokens_to_ids("<"),
        "template": tok.convert_tokens_to_ids("<|endoftext|>"),
    }
    assert f"at token {len(in1)}" in caplog.text


def test_a_reformatted_reply_is_reported_where_it_departs(tiny_ckpt):
    """The agent sends its first reply back with other content, so the proxy cannot reuse the generated tokens: the
    session becomes two Samples, and the first is reported where the agent's version of the conversation departs
    from the tokens that are trained (the first generated token); the second is its own conversation exactly."""
    tok = load_tokenizer(tiny_ckpt)
    engine = ScriptedEngine(tok, spell_out=False)
    with serving(AgentProxy(engine, tok, check_fidelity=True)) as p:
        client = _sdk(p, "R")
        messages = [{"role": "user", "content": "add one and ten"}]
        r1 = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        (call,) = r1.choices[0].message.tool_calls
        messages += [
            {
                "role": "assistant",
                "content": "calling add",
                "tool_calls": [call.model_dump(include={"id", "type", "function"})],
            },
            {"role": "tool", "tool_call_id": call.id, "content": "11"},
        ]
        client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    first, second = p.samples(named(p, "R"))
    (_, in1, out1), _ = engine.calls
    assert first.tokens == in1 + out1
    assert first.metadata["token_fidelity"] == {
        "position": len(in1),
        "trained": out1[0],
        "template": tok.convert_tokens_to_ids("c"),
    }
    assert second.metadata["token_fidelity"] is None


def test_the_flag_reaches_the_proxy_through_agent_rollout(tiny_ckpt):
    from lichen.rollout import agent_rollout
    from lichen.rollout.custom_generate import run_custom_generate
    from lichen.types import Sample

    tok = load_tokenizer(tiny_ckpt)
    params = [{"max_new_tokens": 300, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "sampling_seed": 40}]
    found = {}
    for check in (False, True):
        args = argparse.Namespace(
            tool_paths=None,
            max_turns=8,
            tool_timeout=30.0,
            tool_call_parser="hermes",
            check_token_fidelity=check,
            agent_function_path="helpers.agent_proxy.sdk_agent",
        )
        sample = Sample(prompt="add one and ten", tokens=[1], index=0)
        ((s,),) = run_custom_generate(
            agent_rollout.generate, args, [sample], params, engine=ScriptedEngine(tok), tokenizer=tok
        )
        found[check] = s.metadata.get("token_fidelity", "absent")
        prompt_len = len(s.tokens) - s.response_length
    assert found[False] == "absent"
    assert found[True] == {
        "position": prompt_len,
        "trained": tok.convert_tokens_to_ids("<"),
        "template": tok.convert_tokens_to_ids("<|endoftext|>"),
    }
