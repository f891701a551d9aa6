"""Tool calls on `lichen serve`'s OpenAI endpoints (docs/agentic.md): the Hermes/Qwen parser (valid, malformed and
partial-stream calls), parser plug-ins by dotted path, `tool_choice`, the refusal of a template that ignores
`tools`, and the official `openai` SDK against the server: in process with scripted engine output (so the model
"calls" a tool), and against a real `lichen serve` process."""

from __future__ import annotations

import json
import os
import shutil

import openai
import pytest
from helpers.serve_process import launch
from helpers.tool_calls import CALL, MSGS, TOOLS, scripted  # noqa: F401 - `scripted` is a fixture

from lichen.engines.api.tool_parsers import TaggedJsonParser, ToolCall, load_parser
from lichen.errors import ConfigError

P = TaggedJsonParser()


# ---- parsing ------------------------------------------------------------------------------------------------------
def test_valid_calls_and_content_around_them():
    out = P.parse("Let me add.\n" + CALL + "\n" + CALL.replace('"a": 1', '"a": 5'))
    assert out.content == "Let me add.\n\n"  # exactly the calls' blocks removed
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [
        ("add", {"a": 1, "b": 2}),
        ("add", {"a": 5, "b": 2}),
    ]
    assert len({c.id for c in out.calls}) == 2
    only = P.parse(CALL)
    assert only.content is None and len(only.calls) == 1
    # arguments given as a JSON string are read as the object they encode
    assert json.loads(
        P.parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>').calls[0].arguments
    ) == {"x": 1}


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "add", "arguments": {</tool_call>',  # bad JSON
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        "<tool_call>[1, 2]</tool_call>",  # not an object
        '<tool_call>{"name": "f", "arguments": 3}</tool_call>',  # arguments not an object
        'answer <tool_call>{"name": "add", "arguments": {}}',
    ],
)  # never closed
def test_malformed_calls_stay_in_the_content(text):
    out = P.parse(text)
    assert out.calls == [] and out.content == text


def stream_all(parser, text: str, step: int = 1) -> tuple[str, list[ToolCall], list[str]]:
    st = parser.stream()
    content, calls, deltas = "", [], []
    for end in list(range(step, len(text), step)) + [len(text)]:
        delta, new = st.feed(text[:end], end == len(text))
        content += delta
        calls += new
        deltas.append(delta)
    return content, calls, deltas


@pytest.mark.parametrize(
    "text",
    [
        "Let me add.\n" + CALL + "\nDone, it is 3.",
        CALL,
        "no call here at all",
        "x <tool_call>{broken}</tool_call> y",
        'tail <tool_call>{"name": "add"',
        "  spaced  \n" + CALL + "\n\n" + CALL + "\n",
    ],
)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streaming_joins_to_the_parse_and_never_leaks_a_partial_tag(text, step):
    content, calls, deltas = stream_all(P, text, step)
    whole = P.parse(text)
    assert content == (whole.content or "")
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.calls]
    if whole.calls:  # no piece of a call that parsed was ever sent as content
        assert not any("<tool" in d or '"name"' in d for d in deltas)


class UpperParser:
    """A plug-in parser: the whole reply is one call `upper` with the text as its argument."""

    def parse(self, text):
        from lichen.engines.api.tool_parsers import ParsedOutput

        return ParsedOutput(None, [ToolCall("upper", json.dumps({"text": text}))])

    def stream(self):
        raise NotImplementedError


def test_parser_flag_names_builtins_plugins_and_refuses_the_rest():
    assert isinstance(load_parser("qwen25"), TaggedJsonParser)
    assert load_parser("none") is None
    assert isinstance(load_parser("test_tool_calls.UpperParser"), UpperParser)
    for bad, words in (
        ("mistral", "unknown parser"),
        ("test_tool_calls.nothing", "no attribute"),
        ("json.JSONDecoder", "needs parse(text) and stream()"),
    ):
        with pytest.raises(ConfigError) as e:
            load_parser(bad)
        assert str(e.value).startswith(f"--tool-call-parser {bad!r}") and words in str(e.value)


def test_sdk_gets_tool_calls_and_sends_them_back(scripted):  # noqa: F811 - the fixture
    s = scripted("Let me add.\n" + CALL)
    r = s.client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, logprobs=True)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me add.\n"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 1, "b": 2}
    assert len(choice.logprobs.content) == len(s.ids)  # every generated token (EOS too) keeps its log-prob
    # the tools reached the template
    assert '"name": "add"' in s.tok.decode(s.prompts[-1])
    # the SDK's assistant message with tool_calls, and a tool result, render as the next prompt
    s.client.chat.completions.create(
        model="tiny",
        tools=TOOLS,
        messages=[
            *MSGS,
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "3"},
        ],
    )
    assert s.tok.decode(s.prompts[-1]).endswith("<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n")


def test_sdk_streams_tool_call_deltas(scripted):  # noqa: F811 - the fixture
    s = scripted("Sure.\n" + CALL + "\n" + CALL.replace('"a": 1', '"a": 7'))
    chunks = list(
        s.client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, stream=True, logprobs=True)
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert content == "Sure.\n\n"
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)["a"]) for tc in calls] == [
        (0, "add", 1),
        (1, "add", 7),
    ]
    assert all(tc.id and tc.type == "function" for tc in calls)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # log-probs of the tokens whose text was held (the calls) are sent too, each once
    lps = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert lps == pytest.approx([-0.01 * (n + 1) for n in range(len(s.ids))])


def test_without_tools_nothing_is_parsed(scripted):  # noqa: F811 - the fixture
    s = scripted(CALL)
    r = s.client.chat.completions.create(model="tiny", messages=MSGS)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == CALL
    r = s.client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert "# Tools" not in s.tok.decode(s.prompts[-1])  # "none": the model is not shown the tools


@pytest.mark.parametrize(
    "choice, words",
    [
        ("required", 'tool_choice "required" is not supported'),
        (
            {"type": "function", "function": {"name": "add"}},
            'tool_choice {"type": "function", "function": {"name": "add"}} is not',
        ),
    ],
)
def test_tool_choice_that_forces_a_call_is_refused(scripted, choice, words):  # noqa: F811 - the fixture
    s = scripted(CALL)
    with pytest.raises(openai.BadRequestError) as e:
        s.client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice=choice)
    assert words in str(e.value)


def test_template_that_ignores_tools_is_a_400_naming_it(scripted):  # noqa: F811 - the fixture
    plain = (
        "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
        "{%- endif %}"
    )
    s = scripted(CALL, template=plain)
    with pytest.raises(openai.BadRequestError) as e:
        s.client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS)
    assert "ignores `tools`" in str(e.value) and "tokenizer_config.json" in str(e.value)
    assert s.client.chat.completions.create(model="tiny", messages=MSGS).choices[0].message.content == CALL


def test_parser_none_refuses_tools(scripted):  # noqa: F811 - the fixture
    s = scripted(CALL, parser="none")
    with pytest.raises(openai.BadRequestError) as e:
        s.client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS)
    assert "--tool-call-parser none" in str(e.value)


# ---- a real `lichen serve` process --------------------------------------------------------------------------------
@pytest.mark.slow
def test_real_server_with_the_sdk(tiny_ckpt, tmp_path):
    """The flag reaches the process (a plug-in parser by dotted path), and a template without tool support is
    refused by the real server too."""
    no_tools = tmp_path / "no_tools"
    shutil.copytree(tiny_ckpt, no_tools)
    cfg_path = no_tools / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = cfg["chat_template"].replace("{%- if tools %}", "{%- if false %}")
    cfg_path.write_text(json.dumps(cfg))
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    proc = launch(tiny_ckpt, "--num-threads", "1", "--tool-call-parser", "test_tool_calls.UpperParser", env=env)
    bare = launch(str(no_tools), "--num-threads", "1")
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(model=tiny_ckpt, messages=MSGS, tools=TOOLS, max_tokens=5, temperature=0)
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "upper" and r.usage.completion_tokens <= 5
        bare_client = openai.OpenAI(base_url=bare.url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            bare_client.chat.completions.create(model=str(no_tools), messages=MSGS, tools=TOOLS, max_tokens=2)
        assert "ignores `tools`" in str(e.value)
    finally:
        proc.stop()
        bare.stop()


def test_serve_flag_is_checked_before_the_model_loads(tiny_ckpt):
    from lichen.engines.server.serve import build_parser, check_args

    args = build_parser().parse_args(["--model", tiny_ckpt, "--tool-call-parser", "mistral"])
    with pytest.raises(ConfigError, match="^--tool-call-parser 'mistral': unknown parser"):
        check_args(args)
    args = build_parser().parse_args(["--model", tiny_ckpt])
    check_args(args)
    assert isinstance(args.tool_parser, TaggedJsonParser)


# ---- text fidelity (issue 30 item 5): with `tools` sent, the reply text is the generated text ------------------------
@pytest.mark.parametrize(
    "reply",
    [
        "  \n",  # whitespace only: was turned into null
        "  padded answer \n\n",  # was stripped to "padded answer"
        "x <tool_call>{broken}</tool_call>\n",  # a malformed block is no call: the text stays whole
        "\n" + CALL + "\n",  # whitespace around a call stays; only the call's block goes
        " before\n" + CALL + "\n \n" + CALL.replace('"a": 1', '"a": 9') + "  after ",
    ],
)
def test_reply_text_is_the_generated_text_less_exactly_the_calls(scripted, reply):  # noqa: F811 - the fixture
    s = scripted(reply)
    # the raw generated text: the scripted tokens decoded, as the route decodes them without `tools`
    raw = s.client.chat.completions.create(model="tiny", messages=MSGS).choices[0].message.content
    assert raw == s.tok.decode(s.ids, skip_special_tokens=True) == reply
    blocks = [b for b in (CALL, CALL.replace('"a": 1', '"a": 9')) if b in raw]
    expected = raw
    for b in blocks:
        expected = expected.replace(b, "")
    r = s.client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS).choices[0]
    assert r.message.content == expected
    assert len(r.message.tool_calls or []) == len(blocks)
    assert r.finish_reason == ("tool_calls" if blocks else "stop")
    chunks = list(s.client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert sum(len(c.choices[0].delta.tool_calls or []) for c in chunks if c.choices) == len(blocks)


def test_reply_of_only_a_call_has_null_content(scripted):  # noqa: F811 - the fixture
    s = scripted(CALL)
    r = s.client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS).choices[0]
    assert r.message.content is None and len(r.message.tool_calls) == 1
