"""Checks of OpenAI request bodies: sampling fields, chat messages, the chat template, response_format.

Shared by `lichen serve`'s OpenAI endpoints (lichen/engines/server/openai_api.py) and the agent proxy
(lichen/rollout/agent_proxy.py), so both refuse the same bodies with the same 400s.
"""

from __future__ import annotations

from typing import Any

from lichen.engines.api.protocol import RequestError, Sampling, expect, parse_sampling
from lichen.excerpt import clip, excerpt, json_excerpt

# OpenAI / SGLang-extra request keys that map onto sampling_params (request key -> sampling key).
_SAMPLING_MAP = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "n": "n",
    "stop": "stop",
    "seed": "sampling_seed",
    "min_p": "min_p",
    "stop_token_ids": "stop_token_ids",
    "no_stop_trim": "no_stop_trim",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "repetition_penalty": "repetition_penalty",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "min_tokens": "min_new_tokens",
    "regex": "regex",
    "json_schema": "json_schema",
    "ebnf": "ebnf",
    "logit_bias": "logit_bias",
}


def request_sampling(body: dict, max_new: Any) -> Sampling:
    """The sampling settings of an OpenAI request body, checked as `/generate`'s (also the agent proxy's)."""
    sp = {dst: body[src] for src, dst in _SAMPLING_MAP.items() if body.get(src) is not None}
    sp["max_new_tokens"] = max_new
    return parse_sampling(sp, "request")


def chat_messages(body: dict) -> list[dict]:
    """The request's `messages`, checked (roles, text content) with text content parts joined (also the agent
    proxy's)."""
    messages = body.get("messages")
    expect(messages, (list,), "messages", "a list of messages")
    if not messages:
        raise RequestError("messages cannot be empty", shape="object")
    norm = []
    for i, m in enumerate(messages):
        expect(m, (dict,), f"messages[{i}]", "an object with role and content")
        role = m.get("role")
        if role not in ("system", "user", "assistant", "tool", "developer"):
            raise RequestError(
                f"messages[{i}].role must be system, user, assistant or tool, got {excerpt(role)}", shape="object"
            )
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is supported
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise RequestError(f"messages[{i}]: only text content parts are supported", shape="object")
                parts.append(expect(part.get("text"), (str,), f"messages[{i}].content[].text", "a string"))
            content = "".join(parts)
        elif content is not None:
            expect(content, (str,), f"messages[{i}].content", "a string or a list of content parts")
        norm.append({**m, "content": content if content is not None else ""})
    return norm


def apply_template(tok: Any, messages: list[dict], kwargs: dict) -> str:
    """The prompt text of checked `messages` (a template error is a 400; also the agent proxy's)."""
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    except Exception as e:  # a template error is the request's fault
        raise RequestError(
            f"the chat template failed on these messages: {type(e).__name__}: {clip(str(e))}", shape="object"
        ) from None
    if isinstance(text, list):
        (text,) = text
    return text


def refuse_response_format(body: dict) -> None:
    """JSON mode / JSON schema need constrained decoding, which lichen's engine does not do: refuse them rather
    than answer plain text as if they were honoured. {"type": "text"} is the plain text it gives anyway."""
    rf = body.get("response_format")
    if rf is None:
        return
    expect(rf, (dict,), "response_format", 'an object such as {"type": "text"}')
    if rf.get("type") != "text":
        raise RequestError(
            f"response_format {json_excerpt(rf, 80)} is not supported by lichen serve (no constrained "
            'decoding); leave it out or use {"type": "text"}',
            shape="object",
        )
