"""The multi-turn tool rollout (lichen/rollout/tool_rollout.py) and the agent proxy (lichen/rollout/agent_proxy.py)
over a real vLLM server (`--rollout-engine-backend vllm`, vLLM's own environment .venv-vllm).

A random tiny model almost never writes a well-formed `<tool_call>` block, so calls are made to happen by an
arrangement that holds for any model: every special token and the characters of STOP_CHARS are stop tokens, and
the parser plug-in `StopCharCalls` reads a turn that ended on one of STOP_CHARS as one call of `echo` (a turn that
ended on a special token, its EOS among them, is an answer). So a turn is a run of plain characters: its text
decodes and re-encodes to the very tokens vLLM sampled, and the token-fidelity check has to find no mismatch.
('<' is a stop character, so no turn spells a special token such as `<|im_end|>` out in characters.)

Two vLLM servers in all: the `lichen train` run of the tool rollout launches its own; the agent-proxy tests share
one (module-scoped) behind RemoteEngines."""

from __future__ import annotations

import json

import openai
import pytest
import torch
from helpers.agent_proxy import client as sdk_client
from helpers.agent_proxy import named
from helpers.runs import THREADS, base_args, dumped_samples, pop_engines, run
from helpers.vllm import vllm_python, vllm_tiny_model

from lichen.config import parse_train_args
from lichen.config.engine_config import EngineConfig
from lichen.engines.api.tool_parsers import ParsedOutput, ToolCall
from lichen.engines.clients.client import EngineError, generate_payload
from lichen.engines.clients.remote_engines import RemoteEngines
from lichen.engines.clients.vllm_client import vllm_generate_body
from lichen.engines.core.engine import GenRequest
from lichen.models import load_model
from lichen.models.tokenizer import load_tokenizer
from lichen.rollout.agent_proxy import AgentProxy

pytestmark = pytest.mark.e2e  # see the marker in pyproject.toml: make test leaves it to make test-e2e

SPECIAL_IDS = [0, 1, 2, 3, 4]  # the tiny tokenizer's <|pad|>, <|endoftext|>, <|im_start|>, <|im_end|>, <|unk|>
STOP_CHARS = "0123456789.,;:!?()<>"
VLLM_FLAGS = ["--vllm-max-model-len", "512", "--vllm-optimization-level", "0"]  # -O0: no torch.compile
# vLLM's float32 CPU kernels against lichen's float64 model (tests/test_vllm_protocol.py explains the margin)
LOGPROB_TOL = 1e-3


def echo(text: str) -> str:
    """Say how long a text is."""
    return f"{len(text)} characters"


ECHO = {
    "type": "function",
    "function": {
        "name": "echo",
        "description": "Say how long a text is.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    },
}


class StopCharCalls:
    """A --tool-call-parser plug-in: a text that ends with one of STOP_CHARS is one call of `echo` with the text
    (kept as the content too); any other text is an answer."""

    def parse(self, text: str) -> ParsedOutput:
        if text and text[-1] in STOP_CHARS:
            return ParsedOutput(text, [ToolCall("echo", json.dumps({"text": text}))])
        return ParsedOutput(text, [])

    def stream(self) -> _WholeStream:
        return _WholeStream(self)


class _WholeStream:
    """Streams nothing before the end (a call is known only from the last character)."""

    def __init__(self, parser: StopCharCalls):
        self.parser = parser

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        if not final:
            return "", []
        parsed = self.parser.parse(text)
        return parsed.content or "", parsed.calls


def one_vllm_engine(weights) -> list[str]:
    """The flags of a run with one launched vLLM engine, weights synced through the directory `weights`."""
    sync = ["--update-weight-transport", "disk", "--update-weight-disk-dir", str(weights)]
    return ["--rollout-engine-backend", "vllm", "--rollout-num-engines", "1", *sync, *VLLM_FLAGS]


def stop_ids(tok) -> list[int]:
    return SPECIAL_IDS + [t for c in STOP_CHARS for t in tok.encode(c, add_special_tokens=False)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return vllm_tiny_model(str(tmp_path_factory.mktemp("vllm_tiny")))


@pytest.fixture(scope="module")
def tok(ckpt):
    return load_tokenizer(ckpt)


def reference_logprobs(model, tokens: list[int]) -> list[float]:
    """log_softmax(logits) (T = 1) of each token after the first, from lichen's own model in float64."""
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logits = model.logits(model(ids, torch.arange(ids.shape[1])[None]))[0]
    logp = torch.log_softmax(logits, dim=-1)
    return [0.0] + [float(logp[k - 1, t]) for k, t in enumerate(tokens) if k > 0]


def _runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(mask value, start, end) of each run of equal loss-mask values."""
    out, k = [], 0
    while k < len(mask):
        j = k
        while j < len(mask) and mask[j] == mask[k]:
            j += 1
        out.append((mask[k], k, j))
        k = j
    return out


def _check_turns(tok, s: dict, model=None) -> None:
    """One dumped sample of the tool rollout: its response is policy turns (loss mask 1, vLLM's log-probs: against
    `model`'s in float64 when given) and, after each turn that ended on a stop character, the template's tool turn
    for the call's result (loss mask 0, log-prob 0.0); the trained tokens are apply_chat_template's."""
    md, n = s["metadata"], s["response_length"]
    response, mask, lps = s["tokens"][-n:], s["loss_mask"], s["rollout_log_probs"]
    assert len(mask) == len(lps) == n
    assert md["token_fidelity"] is None, md["token_fidelity"]
    (served,) = set(pop_engines(s))  # one server, a launched vLLM one
    assert served.startswith("http://127.0.0.1:")
    runs = _runs(mask)
    policy = [(a, b) for m, a, b in runs if m == 1]
    tools = [(a, b) for m, a, b in runs if m == 0]
    assert [m for m, _, _ in runs] == [1, 0] * len(tools) + [1] * (len(policy) - len(tools))
    assert len(policy) == md["turns"] and len(tools) == len(md["tool_calls"])
    for (a, b), call, (_, end) in zip(tools, md["tool_calls"], policy):
        assert lps[a:b] == [0.0] * (b - a)
        assert call["name"] == "echo" and call["result"] == echo(**json.loads(call["arguments"]))
        assert tok.decode(response[end - 1 : end]) in STOP_CHARS  # the turn before ended on a stop character
        text = tok.decode(response[a:b], skip_special_tokens=False)
        expect = f"<|im_end|>\n<|im_start|>tool\n{call['result']}<|im_end|>\n<|im_start|>assistant\n"
        assert text == expect or (md["stop"] == "budget" and expect.startswith(text))
    for a, b in policy:
        assert all(t > 4 for t in response[a : b - 1]) and all(x < 0 for x in lps[a:b])  # plain characters
    if model is not None:  # vLLM's log-probs of its own tokens, against lichen's model in float64
        ref = reference_logprobs(model, s["tokens"])[-n:]
        assert max(abs(x - y) for x, y, m in zip(lps, ref, mask) if m) < LOGPROB_TOL


# ---- the tool rollout in a `lichen train` run over a launched vLLM engine ------------------------------------------
@pytest.mark.slow
def test_tool_rollout_trains_vllms_turns_and_the_templates_tool_turns(ckpt, tok, addition_data, tmp_path):
    vllm_python()  # fails (or skips with LICHEN_SKIP_VLLM=1) without vLLM's environment
    dump = str(tmp_path / "r_{rollout_id}.pt")
    argv = base_args(
        ckpt,
        addition_data,
        tmp_path / "out",
        "--num-rollout",
        "2",
        *THREADS,
        *one_vllm_engine(tmp_path / "weights"),
        "--apply-chat-template",
        "--rollout-max-response-len",
        "120",
        "--tool-paths",
        "test_vllm_tools.echo",
        "--tool-call-parser",
        "test_vllm_tools.StopCharCalls",
        "--max-turns",
        "3",
        "--check-token-fidelity",
        "--rollout-stop-token-ids",
        *[str(t) for t in stop_ids(tok)],
        "--save-debug-rollout-data",
        dump,
    )
    rows = [r for r in run(argv) if "train/train_rollout_logprob_abs_diff" in r]
    assert len(rows) == 2
    model = load_model(ckpt, dtype=torch.float64).eval()  # the weights of step 0's rollout
    calls = 0
    for step in (0, 1):
        samples = dumped_samples(dump.format(rollout_id=step))
        assert len(samples) == 16
        for s in samples:
            assert s["weight_versions"] == [str(step)]
            _check_turns(tok, s, model if step == 0 else None)
            calls += len(s["metadata"]["tool_calls"])
    print("tool calls in 32 samples:", calls)
    assert calls >= 16  # most trajectories called the tool (each turn ends on a stop character or a special)
    diffs = [r["train/train_rollout_logprob_abs_diff"] for r in rows]
    print("train_rollout_logprob_abs_diff per step:", diffs)
    # vLLM's float32 CPU kernels against lichen's: close, never bit-equal (equal would mean lichen's own log-probs)
    assert all(0 < d < 1e-3 for d in diffs), diffs


# ---- the agent proxy in front of a vLLM engine ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(ckpt, tmp_path_factory, addition_data):
    vllm_python()
    out = tmp_path_factory.mktemp("vllm_run")
    argv = base_args(
        ckpt,
        addition_data,
        out,
        "--num-rollout",
        "1",
        *THREADS,
        *one_vllm_engine(out / "weights"),
    )
    engines = RemoteEngines.from_config(EngineConfig.from_args(parse_train_args(argv[1:])))
    try:
        yield engines
    finally:
        engines.close()


@pytest.fixture(scope="module")
def proxy(engines, tok):
    p = AgentProxy(engines, tok, parser=StopCharCalls(), check_fidelity=True, max_new_tokens=64)
    engines.run(p.start())  # on the engines' loop, where their agenerate runs
    try:
        yield p
    finally:
        engines.run(p.stop())


def _direct(engines, turn, max_tokens: int, seed: int, **kw):
    """vLLM's answer to the same request sent straight to it (same prompt ids, same seed)."""
    (r,) = engines.generate([GenRequest(turn.prompt_ids, max_tokens, seed=seed, **kw)])
    return r


@pytest.mark.slow
def test_an_sdk_agent_calls_a_tool_and_the_session_is_vllms_tokens(proxy, engines, tok):
    """Two requests of an `openai`-SDK agent: a reply that ended on a stop character comes back as a tool call, the
    agent runs it and asks again; the session is one Sample of vLLM's tokens and log-probs with the tool turn
    masked, and each turn is what vLLM generates for the same request sent to it directly."""
    client = sdk_client(proxy, "agent")
    stops = stop_ids(tok)
    kw = dict(model="policy", tools=[ECHO], temperature=1.0, logprobs=True, max_tokens=24)
    extra = {"extra_body": {"stop_token_ids": stops}}
    messages = [{"role": "user", "content": "say something"}]
    r1 = client.chat.completions.create(messages=messages, seed=7, **kw, **extra)
    assert r1.choices[0].finish_reason == "tool_calls", r1.choices[0]  # seed 7's turn ends on a stop character
    (call,) = r1.choices[0].message.tool_calls
    result = echo(**json.loads(call.function.arguments))
    messages += [
        r1.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    r2 = client.chat.completions.create(messages=messages, seed=8, **kw, **extra)
    t1, t2 = proxy.sessions[named(proxy, "agent")].turns
    for turn, reply, seed in ((t1, r1, 7), (t2, r2, 8)):
        direct = _direct(engines, turn, 24, seed, temperature=1.0, stop_token_ids=stops)
        assert turn.output_ids == direct.output_ids
        assert turn.logprobs == pytest.approx(direct.output_logprobs, abs=1e-6)
        assert [e.logprob for e in reply.choices[0].logprobs.content] == turn.logprobs
        assert turn.engine == engines.urls[0]
    # the second request continued the first one's exact tokens; only the tool turn is new
    have = t1.prompt_ids + t1.output_ids
    assert t2.prompt_ids[: len(have)] == have
    tool = t2.prompt_ids[len(have) :]
    assert tok.decode(tool) == f"<|im_end|>\n<|im_start|>tool\n{result}<|im_end|>\n<|im_start|>assistant\n"
    (sample,) = proxy.samples(named(proxy, "agent"))
    assert sample.tokens == have + tool + t2.output_ids
    assert sample.loss_mask == [1] * len(t1.output_ids) + [0] * len(tool) + [1] * len(t2.output_ids)
    assert sample.rollout_log_probs == t1.logprobs + [0.0] * len(tool) + t2.logprobs
    assert sample.metadata["token_fidelity"] is None


def test_a_stream_over_vllm_is_one_event_with_the_non_streamed_reply(proxy, engines):
    """The same request with and without streaming (same seed): vLLM's stream is the whole output as one event, so
    the content comes in one chunk (with the finish reason); it, the log-probs and the recorded turn are the
    non-streaming request's."""
    kw = dict(
        model="policy",
        messages=[{"role": "user", "content": "tell me a story"}],
        max_tokens=24,
        seed=11,
        temperature=1.0,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    whole = sdk_client(proxy, "N").chat.completions.create(**kw)
    chunks = list(sdk_client(proxy, "S").chat.completions.create(**kw, stream=True))
    (n,), (s,) = proxy.sessions[named(proxy, "N")].turns, proxy.sessions[named(proxy, "S")].turns
    assert len(n.output_ids) == 24 and n.finish_reason == "length"
    assert s == n  # prompt ids, output ids, log-probs, finish reason, engine, version, messages
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) == 1 and content[0] is chunks[-1] and chunks[-1].choices[0].finish_reason == "length"
    assert content[0].choices[0].delta.content == whole.choices[0].message.content
    assert [e.logprob for e in content[0].choices[0].logprobs.content] == n.logprobs
    assert [e.logprob for e in whole.choices[0].logprobs.content] == n.logprobs
    direct = _direct(engines, n, 24, 11, temperature=1.0, ignore_eos=True)
    assert n.output_ids == direct.output_ids


def test_truncated_sampling_is_refused_not_reported_under_another_convention(proxy):
    """vLLM reports a top-p / top-k sample's log-probs over the kept tokens (lichen trains on the full
    vocabulary's): an agent that asks for it gets one clear error and nothing is recorded."""
    for extra in ({"top_p": 0.9}, {"extra_body": {"top_k": 5}}):
        with pytest.raises(openai.InternalServerError, match="renormalised over the kept tokens"):
            sdk_client(proxy, "T").chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "x"}], max_tokens=4, **extra
            )
    assert proxy.samples(named(proxy, "T")) == []
    for req in (GenRequest([5], 2, top_p=0.5), GenRequest([5], 2, top_k=3)):
        with pytest.raises(EngineError, match="top_p 1 and top_k -1"):
            vllm_generate_body(generate_payload(req))
    assert vllm_generate_body(generate_payload(GenRequest([5], 2)))["sampling_params"]["top_k"] == 0


def test_a_turn_that_stops_on_the_first_character_of_the_templates_closing_text_keeps_it(tok):
    """A turn that stopped on the plain character `<` (a stop id above) is followed by the template's whole
    `<|im_end|>`: only a stop token that IS the template's first token is not added twice (the trained tokens
    then disagreed with the template at `|`, which the fidelity check of the run above caught)."""
    from lichen.rollout.tool_rollout import tool_turn_ids

    msgs = [{"role": "tool", "name": "echo", "content": "3"}]
    whole = tok.encode("<|im_end|>\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert tool_turn_ids(tok, msgs, "<") == whole
    assert tool_turn_ids(tok, msgs, "<|im_end|>") == whole[1:]
