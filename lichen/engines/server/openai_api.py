"""OpenAI-compatible endpoints of `lichen serve` (docs/architecture.md#openai-endpoints): /v1/models, /v1/completions,
/v1/chat/completions, with log-probs and streaming, so agent frameworks can drive rollouts.

Both completion endpoints map onto the same jobs as `/generate`; log-probs follow lichen's convention
(log_softmax(logits / T) over the full vocabulary). Chat prompts are rendered with the tokenizer's chat
template (`chat_template_kwargs` passed through). `tools` reach the template and calls in the output are parsed
into `tool_calls` by the server's --tool-call-parser (lichen/engines/api/tool_parsers.py; `tool_choice` in
lichen/engines/api/chat_tools.py, docs/agentic.md).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from aiohttp import web

from lichen.engines.api.chat_tools import refuse_ignored_tools, template_messages, tool_mode
from lichen.engines.api.openai_requests import apply_template, chat_messages, refuse_response_format, request_sampling
from lichen.engines.api.protocol import (
    Job,
    OutputOptions,
    RequestError,
    Sampling,
    bool_field,
    check_sequences,
    check_text,
    error_body,
    expect,
    int_field,
    int_list,
    loads,
    make_job,
    stream_error,
)
from lichen.engines.api.tool_parsers import tool_finish_reason
from lichen.engines.server.responses import abort_status, output_text
from lichen.excerpt import excerpt
from lichen.observe.metrics import get_logger

if TYPE_CHECKING:
    from lichen.engines.server.http_server import LichenServer

log = get_logger(__name__)
T = TypeVar("T")


def add_routes(app: web.Application, server: "LichenServer") -> None:
    app.router.add_get("/v1/models", lambda r: models(server, r))
    app.router.add_get("/v1/models/{model:.+}", lambda r: model_card(server, r))
    app.router.add_post("/v1/completions", lambda r: completions(server, r))
    app.router.add_post("/v1/chat/completions", lambda r: chat_completions(server, r))


def _card(server: "LichenServer") -> dict:
    return {
        "id": server.served_model_name,
        "object": "model",
        "created": int(server.started),
        "owned_by": "lichen",
        "root": server.model_path,
        "max_model_len": server.facts.context_length,
    }


async def models(server: "LichenServer", request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_card(server)]})


async def model_card(server: "LichenServer", request: web.Request) -> web.Response:
    name = request.match_info["model"]
    if name != server.served_model_name:
        return web.json_response(
            {
                "error": {
                    "message": f"The model '{name}' does not exist",
                    "type": "invalid_request_error",
                    "param": "model",
                    "code": "model_not_found",
                }
            },
            status=404,
        )
    return web.json_response(_card(server))


async def _read(server: "LichenServer", request: web.Request, prepare: Callable[["LichenServer", dict], T]) -> T:
    """The body, decoded and turned into jobs by `prepare(server, body)` in the server's parse threads: JSON
    decoding, chat templating and tokenizing never run on the event loop."""
    if request.content_type != "application/json":
        raise RequestError(
            f"Content-Type must be application/json, got {excerpt(request.content_type)}", shape="object"
        )
    raw = await request.read()

    def parse() -> T:
        return prepare(server, expect(loads(raw), (dict,), "the request body", "a JSON object"))

    return await server.offload(parse)


def _jobs(
    server: "LichenServer", prompts: list[list[int]], body: dict, sp: Sampling, opts: OutputOptions, stream: bool
) -> list[Job]:
    base = body.get("rid") or uuid.uuid4().hex
    expect(base, (str,), "rid", "a string")
    jobs = []
    for i, ids in enumerate(prompts):
        for j in range(sp.n):
            k = i * sp.n + j
            job = make_job(f"{base}_{k}", k, ids, sp, j, opts, server.facts, f"prompt[{i}]")
            job.stream = stream
            jobs.append(job)
    return jobs


def _finish(job: Job) -> tuple[str | None, Any]:
    f = job.seq.finish
    if f is None:
        return None, None
    return f[0], (f[1] if f[0] == "stop" else None)


def _usage(prompts: list[list[int]], jobs: list[Job]) -> dict:
    p = sum(len(x) for x in prompts)
    c = sum(len(j.seq.output_ids) for j in jobs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c, "prompt_tokens_details": None}


def _stream_options(body: dict) -> bool:
    so = body.get("stream_options") or {}
    expect(so, (dict,), "stream_options", "a JSON object")
    return bool_field(so, "include_usage", False, "stream_options.")


def _held(text: str, stops: tuple[str, ...]) -> str:
    """What of a growing text is safe to send: not a trailing partial character, nor a possible stop prefix."""
    cut = len(text)
    if text.endswith("\ufffd"):
        cut = len(text.rstrip("\ufffd"))
    for s in stops:
        for k in range(min(len(s) - 1, cut), 0, -1):
            if text[:cut].endswith(s[:k]):
                cut -= k
                break
    return text[:cut]


class _Delta:
    """Per-choice streaming state: how much text and how many tokens were sent."""

    def __init__(self):
        self.text, self.tokens, self.started = "", 0, False
        self.lp_sent = 0  # tokens whose log-probs were sent (chat streams)

    def step(self, job: Job, server: "LichenServer", n: int | None, prefix: str = "") -> tuple[str, int, int]:
        final = n is None
        n = len(job.seq.output_ids) if final else n
        full = prefix + output_text(job, server.detok, n, final)
        if not final:
            full = _held(full, job.seq.stop_strings)
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        if delta:
            self.text = full
        start, self.tokens = self.tokens, n
        return delta, start, n


async def sse_stream(request: web.Request, server: "LichenServer", jobs: list[Job], make_chunks) -> web.StreamResponse:
    """Drive `stream_jobs` and write what `make_chunks(job, n)` returns as SSE events; `make_chunks(None, None)`
    gives the closing events before [DONE]. Shared by /generate and the OpenAI routes."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    events = server.stream_jobs(jobs)
    try:
        async for job, n in events:
            if not resp.prepared:
                await resp.prepare(request)
            for chunk in make_chunks(job, n):
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if not resp.prepared:
            await resp.prepare(request)
        for chunk in make_chunks(None, None):
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
    except ConnectionResetError:  # the client went away; closing `events` aborts its requests
        pass
    except Exception as e:
        if not resp.prepared:
            raise
        log.exception("error while streaming %s", request.path)
        await stream_error(resp, e)
    finally:
        await events.aclose()
    return resp


def _error_if_failed(jobs: list[Job]) -> web.Response | None:
    for j in jobs:
        status = abort_status(j)
        if status is not None:
            return web.json_response(error_body(j.seq.finish[1], status, "object"), status=status)
    return None


# ---- /v1/completions ----------------------------------------------------------------------------------------
def _prompts(server: "LichenServer", prompt: Any, n: int) -> tuple[list[list[int]], list[str]]:
    """Token ids and texts of `prompt`; its count (x n samples) and each text's length are checked first."""
    tok, facts = server.facts.tokenizer, server.facts
    if isinstance(prompt, str):
        prompt = [prompt]
    expect(prompt, (list,), "prompt", "a string, a list of strings, a list of ints or a list of lists of ints")
    if not prompt:
        raise RequestError("prompt cannot be empty", shape="object")
    check_sequences((len(prompt) if isinstance(prompt[0], (list, str)) else 1) * n, facts)
    if all(isinstance(p, str) for p in prompt):
        for i, p in enumerate(prompt):
            check_text(p, facts, f"prompt[{i}]")
        return [list(tok.encode(p)) for p in prompt], list(prompt)
    if isinstance(prompt[0], list):
        ids = [int_list(p, "prompt") for p in prompt]
    else:
        ids = [int_list(prompt, "prompt")]
    return ids, [server.detok.text(p, False) for p in ids]


def _completion_logprobs(server, job: Job, start: int, end: int, top: int, echo: bool, offset: int) -> dict:
    seq, d = job.seq, server.detok
    pairs = list(zip(seq.output_logprobs[start:end], seq.output_ids[start:end]))
    tops = seq.output_top[start:end] if top else []
    if echo and start == 0 and seq.input_logprobs is not None:
        pairs = list(zip(seq.input_logprobs, seq.input_ids)) + pairs
        tops = list(seq.input_top or [None] * len(seq.input_ids)) + list(tops) if top else []
    tokens = [d.token(t, False) for _, t in pairs]
    offsets, pos = [], offset
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _ in pairs],
        "text_offset": offsets,
        "top_logprobs": [None if p is None else {d.token(t, False): lp for lp, t in p} for p in tops] if top else None,
    }


def _prepare_completion(server: "LichenServer", body: dict) -> tuple:
    if "prompt" not in body:
        raise RequestError("prompt is required", shape="object")
    max_new = int_field(body, "max_tokens", 16, "")
    if max_new <= 0:  # SGLang's CompletionRequest validator: 0 would answer an empty completion
        raise RequestError(f"max_tokens must be positive, got {max_new}", shape="object")
    sp = request_sampling(body, max_new)
    prompts, prompt_texts = _prompts(server, body["prompt"], sp.n)
    lp = body.get("logprobs")
    if lp is not None and (expect(lp, (int,), "logprobs", "an integer") < 0 or lp > 20):
        raise RequestError("logprobs must be between 0 and 20", shape="object")
    echo = bool_field(body, "echo", False, "")
    stream = bool_field(body, "stream", False, "")
    usage = _stream_options(body) if stream else False
    opts = OutputOptions(
        return_logprob=lp is not None,
        logprob_start_len=0 if (echo and lp is not None) else -1,
        top_logprobs_num=lp or 0,
        skip_special_tokens=bool_field(body, "skip_special_tokens", True, ""),
        no_stop_trim=bool_field(body, "no_stop_trim", False, ""),
    )
    return prompts, prompt_texts, lp, echo, stream, usage, _jobs(server, prompts, body, sp, opts, stream)


async def completions(server: "LichenServer", request: web.Request) -> web.StreamResponse:
    prompts, prompt_texts, lp, echo, stream, usage, jobs = await _read(server, request, _prepare_completion)
    n = len(jobs) // len(prompts)
    cid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), server.served_model_name

    def prefix(job: Job) -> str:
        return prompt_texts[job.index // n] if echo else ""

    if stream:
        state = {j.index: _Delta() for j in jobs}

        def chunks(job, k):
            if job is None:
                if usage:
                    yield {
                        "id": cid,
                        "object": "text_completion",
                        "created": created,
                        "model": model,
                        "choices": [],
                        "usage": _usage(prompts, jobs),
                    }
                return
            st = state[job.index]
            delta, a, b = st.step(job, server, k, prefix(job))
            reason, matched = _finish(job) if k is None else (None, None)
            if not delta and reason is None:
                return
            logprobs = None
            if lp is not None:
                logprobs = _completion_logprobs(server, job, a, b, lp, echo and not st.started, 0)
            st.started = True
            yield {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": job.index,
                        "text": delta,
                        "logprobs": logprobs,
                        "finish_reason": reason,
                        "matched_stop": matched,
                    }
                ],
            }

        return await sse_stream(request, server, jobs, chunks)
    await server.run_jobs(jobs)
    failed = _error_if_failed(jobs)
    if failed is not None:
        return failed
    choices = []
    for job in jobs:
        reason, matched = _finish(job)
        logprobs = None
        if lp is not None:
            logprobs = _completion_logprobs(server, job, 0, len(job.seq.output_ids), lp, echo, 0)
        text = prefix(job) + output_text(job, server.detok, len(job.seq.output_ids), True)
        choices.append(
            {"index": job.index, "text": text, "logprobs": logprobs, "finish_reason": reason, "matched_stop": matched}
        )
    return web.json_response(
        {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": _usage(prompts, jobs),
            "metadata": {"weight_version": server.engine.weight_version},
        }
    )


# ---- /v1/chat/completions -----------------------------------------------------------------------------------
def _render_chat(server: "LichenServer", body: dict, tools: list[dict] | None) -> list[int]:
    norm = chat_messages(body)
    # the messages' text before the template renders it: templates render each message's content in full
    check_text("".join(m["content"] for m in norm), server.facts, "messages (their content together)")
    if body.get("continue_final_message"):
        raise RequestError("continue_final_message is not supported by lichen serve", shape="object")
    tok = server.facts.tokenizer
    if getattr(tok, "chat_template", None) is None:
        raise RequestError("the served tokenizer has no chat template; use /v1/completions", shape="object")
    kwargs = body.get("chat_template_kwargs") or {}
    expect(kwargs, (dict,), "chat_template_kwargs", "a JSON object")
    norm = template_messages(norm)
    text = apply_template(tok, norm, {**kwargs, "tools": tools} if tools else kwargs)
    if tools:
        source = f"{server.tokenizer_path} (tokenizer_config.json)"
        refuse_ignored_tools(text, apply_template(tok, norm, kwargs), source)
    return list(tok.encode(text, add_special_tokens=False))


def _chat_logprobs(server, job: Job, start: int, end: int, top: int) -> dict:
    seq, d = job.seq, server.detok

    def entry(lp, t):
        s = d.token(t, False)
        return {"token": s, "bytes": list(s.encode()), "logprob": lp}

    content = []
    for k in range(start, end):
        e = entry(seq.output_logprobs[k], seq.output_ids[k])
        e["top_logprobs"] = [entry(lp, t) for lp, t in seq.output_top[k]] if top else []
        content.append(e)
    return {"content": content}


def _prepare_chat(server: "LichenServer", body: dict) -> tuple:
    refuse_response_format(body)
    tools, parse = tool_mode(body, server.tool_parser, "--tool-call-parser")
    sp = request_sampling(body, body.get("max_completion_tokens", body.get("max_tokens")))
    check_sequences(sp.n, server.facts)
    ids = _render_chat(server, body, tools)
    want_lp = bool_field(body, "logprobs", False, "")
    top = int_field(body, "top_logprobs", 0, "")
    if not 0 <= top <= 20:
        raise RequestError("top_logprobs must be between 0 and 20", shape="object")
    stream = bool_field(body, "stream", False, "")
    usage = _stream_options(body) if stream else False
    opts = OutputOptions(
        return_logprob=want_lp,
        top_logprobs_num=top if want_lp else 0,
        skip_special_tokens=bool_field(body, "skip_special_tokens", True, ""),
        no_stop_trim=bool_field(body, "no_stop_trim", False, ""),
    )
    return ids, parse, want_lp, top, stream, usage, _jobs(server, [ids], body, sp, opts, stream)


async def chat_completions(server: "LichenServer", request: web.Request) -> web.StreamResponse:
    ids, parse, want_lp, top, stream, usage, jobs = await _read(server, request, _prepare_chat)
    cid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), server.served_model_name
    if stream:
        state = {j.index: _Delta() for j in jobs}
        parsers = {j.index: server.tool_parser.stream() for j in jobs} if parse else {}
        calls_sent = {j.index: 0 for j in jobs}

        def chunks(job, k):
            base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
            if job is None:
                if usage:
                    yield {**base, "choices": [], "usage": _usage([ids], jobs)}
                return
            st = state[job.index]
            if not st.started:
                st.started = True
                yield {
                    **base,
                    "choices": [
                        {
                            "index": job.index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
            delta, _, b = st.step(job, server, k)
            reason, matched = _finish(job) if k is None else (None, None)
            msg: dict = {}
            if parse:  # text goes through the parser: content once it cannot start a call, calls once complete
                delta, calls = parsers[job.index].feed(st.text, k is None)
                if calls:
                    msg["tool_calls"] = [c.openai(calls_sent[job.index] + i) for i, c in enumerate(calls)]
                    calls_sent[job.index] += len(calls)
                reason = tool_finish_reason(reason, calls_sent[job.index])
            if delta:
                msg = {"content": delta, **msg}
            if not msg and reason is None:
                return
            # log-probs of every token since the last chunk, also of tokens whose text was held back
            logprobs = _chat_logprobs(server, job, st.lp_sent, b, top) if want_lp else None
            st.lp_sent = b
            choice = {"index": job.index, "delta": msg, "logprobs": logprobs, "finish_reason": reason}
            if reason is not None:
                choice["matched_stop"] = matched
            yield {**base, "choices": [choice]}

        return await sse_stream(request, server, jobs, chunks)
    await server.run_jobs(jobs)
    failed = _error_if_failed(jobs)
    if failed is not None:
        return failed
    choices = []
    for job in jobs:
        reason, matched = _finish(job)
        n = len(job.seq.output_ids)
        content, calls = output_text(job, server.detok, n, True), None
        if parse:
            parsed = server.tool_parser.parse(content)
            content, calls = parsed.content, [c.openai() for c in parsed.calls] or None
            reason = tool_finish_reason(reason, len(parsed.calls))
        choices.append(
            {
                "index": job.index,
                "message": {"role": "assistant", "content": content, "reasoning_content": None, "tool_calls": calls},
                "logprobs": _chat_logprobs(server, job, 0, n, top) if want_lp else None,
                "finish_reason": reason,
                "matched_stop": matched,
            }
        )
    return web.json_response(
        {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": _usage([ids], jobs),
            "metadata": {"weight_version": server.engine.weight_version},
        }
    )
