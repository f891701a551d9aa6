"""The agentic demo's pieces (examples/agentic_calculator.py, docs/agentic.md#demo): the SFT traces are what the
tool rollout would produce (the template's conversation, tool turn masked), the call parser and the reward."""

from __future__ import annotations

import json
import os
import sys
import types

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import agentic_calculator as demo  # noqa: E402
from lichen.models.tokenizer import load_tokenizer  # noqa: E402
from lichen.rollout.tool_rollout import check_turn  # noqa: E402


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return load_tokenizer(tiny_ckpt)


def test_sft_trace_is_the_tool_rollouts_conversation_with_the_tool_turn_masked(tok):
    prompt, traj = demo.tool_trace(tok, "4821+3107=", "7928")
    schemas = [{"type": "function", "function": demo.calc.schema}]
    call_len = traj.mask.index(0)
    tool_len = traj.mask[call_len:].index(1)
    call, tool, answer = (traj.tokens[:call_len], traj.tokens[call_len:call_len + tool_len],
                          traj.tokens[call_len + tool_len:])
    assert tok.decode(call) == "<calc>4821+3107</calc><|im_end|>" and tok.decode(answer) == "7928<|im_end|>"
    assert tok.decode(tool) == "\n<|im_start|>tool\n7928<|im_end|>\n<|im_start|>assistant\n"
    assert traj.mask == [1] * call_len + [0] * tool_len + [1] * len(answer)
    # the fidelity check of the tool rollout finds the trace's second turn equal to the template's rendering
    messages = [{"role": "user", "content": "4821+3107="}, {"role": "assistant", "content": "<calc>4821+3107</calc>"},
                {"role": "tool", "name": "calc", "content": "7928"}]
    assert check_turn(tok, messages, schemas, prompt + call + tool) is None
    assert check_turn(tok, messages[:1], schemas, prompt) is None


def test_parser_and_reward():
    parsed = demo.CalcParser().parse("ok <calc>12+3</calc>")
    assert parsed.content == "ok" and [(c.name, json.loads(c.arguments)) for c in parsed.calls] == \
        [("calc", {"expr": "12+3"})]
    assert demo.CalcParser().parse("7928").calls == [] and demo.calc("4821+3107") == "7928"

    def sample(stop, last, label="7928"):
        msgs = [{"role": "user", "content": "4821+3107="}, {"role": "assistant", "content": "<calc>4821+3107</calc>"},
                {"role": "tool", "content": "7928"}, {"role": "assistant", "content": last}]
        return types.SimpleNamespace(metadata={"messages": msgs, "stop": stop}, response="", label=label)

    assert demo.reward(None, sample("answer", "7928")) == 1.0
    assert demo.reward(None, sample("answer", "7929")) == 0.0
    assert demo.reward(None, sample("budget", "7928")) == 0.0  # cut off: no final answer
    assert demo.reward(None, types.SimpleNamespace(metadata={}, response=" 7928", label="7928")) == 1.0
