"""The built-in multi-turn tool rollout (lichen/rollout/tool_rollout.py, docs/agentic.md): the trajectory is the
engine's tokens plus the template's tokens for tool messages (loss mask 0, log-prob 0.0), tools by dotted path
(async, timeouts, errors), the token-fidelity check, the flags, and a training step through the loop whose
trained tokens, loss mask and log-probs are exactly the rollout's."""

from __future__ import annotations

import asyncio
import json

import pytest
from helpers.runs import base_args, dumped_samples, run
from helpers.scripted_policy import scripted_generate
from helpers.tool_rollout import ScriptedEngine, add, boom, enc, rollout, slow  # noqa: F401 - tools by dotted path
from helpers.tool_rollout import tool_args as _args

from lichen.engines.core.engine import Engine
from lichen.engines.core.sampler import derive_seed
from lichen.errors import ConfigError
from lichen.models.tokenizer import encode_prompt, load_tokenizer
from lichen.observe.sample_log import sample_record
from lichen.rollout.tool_rollout import check_turn, first_mismatch, tool_turn_ids
from lichen.rollout.tools import load_tools, run_tool, schema_of
from lichen.types import Status

CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return load_tokenizer(tiny_ckpt)


def test_trajectory_is_the_engines_tokens_plus_the_templates_tool_turns(tok):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    turn1 = enc(tok, "Let me add." + CALL) + [im_end]
    turn2 = enc(tok, "It is 3.") + [im_end]
    out, engine = rollout(tok, [turn1, turn2])
    schemas = [t.schema for t in load_tools(tuple(_args().tool_paths)).values()]
    prompt = encode_prompt(tok, "what is 1+2?", True, tools=schemas)  # the prompt shows the tools
    assert '"name": "add"' in tok.decode(prompt)
    tool = tool_turn_ids(tok, [{"role": "tool", "name": "add", "content": "3"}], "<|im_end|>")
    assert tok.decode(tool) == "\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n"
    assert out.tokens == prompt + turn1 + tool + turn2  # no turn re-encoded
    assert out.response_length == len(turn1 + tool + turn2)
    assert out.loss_mask == [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2)
    assert out.rollout_log_probs == pytest.approx(
        [-0.1 * (k + 1) for k in range(len(turn1))] + [0.0] * len(tool) + [-0.1 * (k + 1) for k in range(len(turn2))]
    )
    assert out.status == Status.COMPLETED and out.weight_versions == ["7"]
    # each turn continues the exact history with the budget left and its own seed
    r1, r2 = engine.requests
    assert r1.input_ids == prompt and r1.seed == 11 and r1.max_new_tokens == 400
    assert r2.input_ids == prompt + turn1 + tool and r2.seed == derive_seed(11, 1)
    assert r2.max_new_tokens == 400 - len(turn1) - len(tool)
    # rewards see the whole trajectory
    md = out.metadata
    assert md["turns"] == 2 and md["stop"] == "answer" and md["token_fidelity"] is None
    assert [(c["name"], json.loads(c["arguments"]), c["result"]) for c in md["tool_calls"]] == [
        ("add", {"a": 1, "b": 2}, "3")
    ]
    assert [m["role"] for m in md["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert "It is 3." in out.response and "<tool_call>" in out.response
    # the sample log names the server of each turn
    assert md["engine"] == ["http://127.0.0.1:9001", "http://127.0.0.1:9000"]
    assert sample_record(out, 1)["engine"] == md["engine"]


def test_fidelity_check_catches_a_retokenized_turn(tok):
    """The same text as other tokens: `<|im_end|>` spelled out in characters instead of its special token. The
    trajectory keeps the engine's tokens; the check reports where they differ from the template's."""
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    spelled = [tok.convert_tokens_to_ids(c) for c in "<|im_end|>"]
    turn1 = enc(tok, "ok ") + spelled + enc(tok, CALL) + [im_end]
    out, _ = rollout(tok, [turn1, enc(tok, "3") + [im_end]])
    prompt_len = len(out.tokens) - out.response_length
    bad = out.metadata["token_fidelity"]
    assert bad == {"position": prompt_len + 3, "trained": spelled[0], "template": im_end}
    assert out.tokens[prompt_len : prompt_len + len(turn1)] == turn1
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2], [1, 2, 3]) == {"position": 2, "trained": None, "template": 3}
    assert check_turn(tok, [{"role": "user", "content": "x"}], None, encode_prompt(tok, "x", True)) is None


def test_turns_and_budget_end_the_trajectory(tok):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    call = enc(tok, CALL) + [im_end]
    out, engine = rollout(tok, [call, call], max_turns=2)
    assert out.status == Status.TRUNCATED and out.metadata["stop"] == "max_turns" and len(engine.requests) == 2
    assert out.loss_mask[-1] == 0  # the last tool turn is in, unanswered
    out, engine = rollout(tok, [call], budget=len(call) + 4)
    assert out.response_length == len(call) + 4 and out.loss_mask == [1] * len(call) + [0] * 4
    assert out.status == Status.TRUNCATED and out.metadata["stop"] == "budget" and len(engine.requests) == 1
    # a call cut off by the length limit is not run
    out, engine = rollout(tok, [enc(tok, CALL)], budget=len(enc(tok, CALL)))
    assert out.metadata["tool_calls"] == [] and out.metadata["stop"] == "budget"


def test_tools_async_timeouts_and_errors(tok):
    tools = load_tools(("test_tool_rollout.add", "test_tool_rollout.slow", "test_tool_rollout.boom"))
    assert schema_of(add, "add")["function"] == {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a"],
        },
    }
    assert tools["boom"].schema == {"type": "function", "function": boom.schema}

    async def go():
        return await asyncio.gather(
            run_tool(tools, "add", '{"a": 2, "b": 5}', 5),
            run_tool(tools, "slow", '{"seconds": 0}', 5),
            run_tool(tools, "slow", '{"seconds": 30}', 0.2),
            run_tool(tools, "boom", "{}", 5),
            run_tool(tools, "nope", "{}", 5),
            run_tool(tools, "add", '{"c": 1}', 5),
        )

    ok, woke, late, broke, unknown, bad = asyncio.run(go())
    assert (ok, woke) == ("7", "woke")
    assert late == "error: slow timed out after 0.2s"
    assert broke == "error: RuntimeError: tool broke"
    assert unknown.startswith("error: unknown tool 'nope'; available: add, boom, slow")
    assert bad.startswith("error: TypeError")


# ---- flags ---------------------------------------------------------------------------------------------------------
def _parse(tiny_ckpt, data, tmp_path, *extra):
    from lichen.config import parse_train_args

    return parse_train_args(base_args(tiny_ckpt, data, tmp_path / "o", "--num-rollout", "1", *extra)[1:])


def test_flags_select_the_rollout_and_are_checked(tiny_ckpt, addition_data, tmp_path):
    args = _parse(tiny_ckpt, addition_data, tmp_path, "--apply-chat-template", "--tool-paths", "test_tool_rollout.add")
    assert args.custom_generate_function_path == "lichen.rollout.tool_rollout.generate"
    args = _parse(
        tiny_ckpt,
        addition_data,
        tmp_path,
        "--apply-chat-template",
        "--agent-function-path",
        "helpers.agent_proxy.sdk_agent",
    )
    assert args.custom_generate_function_path == "lichen.rollout.agent_rollout.generate"
    for extra, words in (
        (["--tool-paths", "test_tool_rollout.nothing"], "--tool-paths 'test_tool_rollout.nothing'"),
        (["--tool-paths", "test_tool_rollout.add"], "pass --apply-chat-template"),
        (["--max-turns", "0"], "--max-turns must be at least 1"),
        (["--tool-timeout", "0"], "--tool-timeout must be a positive"),
        (["--tool-call-parser", "mistral"], "--tool-call-parser 'mistral': unknown parser"),
        (
            [
                "--apply-chat-template",
                "--agent-function-path",
                "helpers.agent_proxy.sdk_agent",
                "--tool-paths",
                "test_tool_rollout.add",
            ],
            "exclude each other",
        ),
        (["--apply-chat-template", "--agent-function-path", "test_tool_rollout.add"], "must be an async function"),
        (
            ["--apply-chat-template", "--tool-paths", "test_tool_rollout.add", "--tool-call-parser", "none"],
            "--tool-call-parser none: the tool rollout",
        ),
    ):
        with pytest.raises(ConfigError, match=words):
            _parse(tiny_ckpt, addition_data, tmp_path, *extra)


# ---- a training step through the loop ------------------------------------------------------------------------------
def test_training_step_trains_exactly_the_rollouts_tokens(tiny_ckpt, addition_data, tmp_path, monkeypatch):
    """The in-process engine is scripted (every sample calls `add`, then answers), with the model's true
    log-probs of the scripted tokens; the trainer must see the same tokens, mask and log-probs."""
    tok = load_tokenizer(tiny_ckpt)
    returned: list[tuple[list[int], list[int]]] = []
    reply = scripted_generate(tok, lambda text: "3" if "<|im_start|>tool" in text else CALL, returned)
    monkeypatch.setattr(Engine, "generate", reply)
    dump = str(tmp_path / "r_{rollout_id}.pt")
    rows = run(
        base_args(
            tiny_ckpt,
            addition_data,
            tmp_path / "o",
            "--num-rollout",
            "1",
            "--num-threads",
            "1",
            "--apply-chat-template",
            "--rollout-max-response-len",
            "200",
            "--tool-paths",
            "test_tool_rollout.add",
            "--check-token-fidelity",
            "--save-debug-rollout-data",
            dump,
        )
    )
    samples = dumped_samples(dump.format(rollout_id=0))
    assert len(samples) == 16 and len(returned) == 32
    calls = {tuple(inp): ids for inp, ids in returned}
    for s in samples:
        prompt = s["tokens"][: len(s["tokens"]) - s["response_length"]]
        turn1 = calls[tuple(prompt)]
        rest = s["tokens"][len(prompt) + len(turn1) :]
        second_input = [inp for inp in calls if len(inp) > len(prompt) and list(inp[: len(prompt)]) == prompt]
        (inp2,) = second_input
        turn2 = calls[inp2]
        tool = list(inp2[len(prompt) + len(turn1) :])
        assert rest == tool + turn2  # the trained tokens are the engine's plus the template's tool turn
        assert s["loss_mask"] == [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2)
        assert s["metadata"]["token_fidelity"] is None and s["metadata"]["tool_calls"][0]["result"] == "3"
    assert rows[0]["train/train_rollout_logprob_abs_diff"] <= 1e-5


def test_code_tool_runs_in_the_sandbox():
    """`lichen.rollout.tools.python`: model-written code runs sandboxed (no network), its output is the result."""
    tools = load_tools(("lichen.rollout.tools.python",))
    assert tools["python"].schema["function"]["parameters"]["required"] == ["code"]
    code = (
        "import socket\nprint(6 * 7)\ntry:\n    socket.create_connection(('127.0.0.1', 22), timeout=1)\n"
        "except OSError as e:\n    print('no network')\nraise SystemExit(3)"
    )

    async def go():
        return await asyncio.gather(
            run_tool(tools, "python", json.dumps({"code": code}), 60),
            run_tool(tools, "python", json.dumps({"code": "1/0"}), 60),
        )

    ran, failed = asyncio.run(go())
    assert ran == "42\nno network\nexit code 3"
    assert "ZeroDivisionError" in failed and failed.endswith("exit code 1")
