"""The agent proxy: an OpenAI-compatible `/v1/chat/completions` in front of lichen's engines that external agent
code (anything built on the `openai` SDK) drives during a rollout, while lichen records every request's prompt
tokens, output tokens and log-probs per session and turns them into Samples (docs/agentic.md#agent-proxy).

Non-streaming and streaming requests are served (a stream follows the generation when the engine has
`agenerate_stream`: lichen/rollout/agent_proxy_stream.py). Sessions are keyed by a per-trajectory base URL
`http://HOST:PORT/sessions/<id>/v1` or by the header `X-Session-Id` on `http://HOST:PORT/v1`; each session's
requests are recorded apart. Token fidelity across turns:
an assistant message the proxy itself returned is rendered back as the raw text it generated, and a prompt whose
text extends the session's last prompt + output reuses those tokens (only the new suffix is encoded), so a
multi-turn conversation becomes one Sample whose policy tokens are exactly the engine's (loss mask 1, their
log-probs) and whose other tokens (tool results, templates) have loss mask 0.

    proxy = AgentProxy(engine, tokenizer)        # engine: async agenerate(GenRequest, session_id) -> GenResult
    await proxy.start()                          # on the loop the engine's agenerate runs on; proxy.url
    ... the agent calls OpenAI(base_url=proxy.session_url("traj-0"), api_key="none") ...
    samples = proxy.samples("traj-0")            # one Sample per token-continuous chain of requests

With `check_fidelity=True` each Sample also gets `metadata["token_fidelity"]`: None, or the first token where it
differs from apply_chat_template of its conversation (see `AgentProxy.fidelity`).
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from lichen.engines.chat_tools import tool_mode
from lichen.engines.engine import GenRequest, GenResult
from lichen.engines.protocol import RequestError
from lichen.engines.tool_parsers import ToolCallParser, load_parser, tool_finish_reason
from lichen.rollout.agent_proxy_stream import ReplyStream, generation, token_logprobs
from lichen.rollout.tool_rollout import first_mismatch
from lichen.rollout.trajectory import Trajectory
from lichen.types import Sample, Status

log = logging.getLogger(__name__)


@dataclass
class Turn:
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: str
    engine: str = ""  # the server that generated it
    messages: list[dict] = field(default_factory=list)  # the request's messages, as the agent sent them
    text: str = ""  # the prompt the proxy rendered from them (apply_chat_template, its own replies as raw text)


@dataclass
class Session:
    turns: list[Turn] = field(default_factory=list)
    raw: dict[str, str] = field(default_factory=dict)  # key of a returned assistant message -> generated text


def _message_key(content: Any, calls: Any) -> str:
    ids = [c.get("id") for c in calls or [] if isinstance(c, dict)]
    return json.dumps([content or "", ids])


def _continues(earlier: list[dict], later: list[dict]) -> bool:
    """Whether `later` is the conversation of `earlier` gone on: its messages, then an assistant reply."""
    n = len(earlier)
    return len(later) > n and later[:n] == earlier and later[n].get("role") == "assistant"


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "invalid_request_error", "code": status}}, status=status
    )


class AgentProxy:
    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        *,
        parser: ToolCallParser | None = None,
        max_new_tokens: int = 1024,
        model_name: str = "lichen-policy",
        check_fidelity: bool = False,
    ):
        self.engine, self.tok = engine, tokenizer
        self.check_fidelity = check_fidelity
        self.parser = parser or load_parser("hermes")
        self.max_new_tokens, self.model_name = max_new_tokens, model_name
        self.sessions: dict[str, Session] = {}
        self.url: str | None = None
        self._runner: web.AppRunner | None = None

    # ---- server ----------------------------------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/sessions/{sid}/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.url = f"http://{host}:{site._server.sockets[0].getsockname()[1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def session_url(self, session_id: str) -> str:
        """The OpenAI base URL of one trajectory."""
        return f"{self.url}/sessions/{session_id}/v1"

    # ---- one request -----------------------------------------------------------------------------------------
    def _render(self, session: Session, body: dict, tools: list[dict] | None) -> str:
        messages = []
        for m in body["messages"]:
            if m.get("role") == "assistant":
                raw = session.raw.get(_message_key(m.get("content"), m.get("tool_calls")))
                if raw is not None:  # ours: render the text the engine generated, not the parsed fields
                    m = {"role": "assistant", "content": raw}
            messages.append(m)
        kwargs = {"tools": tools} if tools else {}
        return self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)

    def _prompt_ids(self, session: Session, text: str) -> list[int]:
        if session.turns:  # continue the last turn's exact tokens when the text extends it
            last = session.turns[-1]
            history = last.prompt_ids + last.output_ids
            done = self.tok.decode(history, skip_special_tokens=False)
            if text.startswith(done):
                return history + self._encode(text[len(done) :])
        return self._encode(text)

    async def _chat(self, request: web.Request) -> web.Response:
        sid = request.match_info.get("sid") or request.headers.get("X-Session-Id")
        if not sid:
            return _error("no session: use the base URL /sessions/<id>/v1 or send the X-Session-Id header")
        try:
            body = await request.json()
        except ValueError:
            return _error("the request body is not JSON")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
            return _error("messages: a non-empty list is required")
        try:  # tool_choice as lichen serve takes it: "none" shows no tools, a forced call is refused (400)
            tools, parse = tool_mode(body, self.parser, "--tool-call-parser")
        except RequestError as e:
            return _error(e.message, e.status)
        session = self.sessions.setdefault(sid, Session())
        text = self._render(session, body, tools)
        ids = self._prompt_ids(session, text)
        req = GenRequest(
            input_ids=ids,
            max_new_tokens=int(body.get("max_tokens") or self.max_new_tokens),
            temperature=float(body.get("temperature", 1.0)),
            top_p=float(body.get("top_p", 1.0)),
            seed=int(body.get("seed") or uuid.uuid4().int % 2**31),
        )
        turn = Turn(ids, [], [], "", "", "", body["messages"], text)
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.get("stream"):
            reply = ReplyStream(
                self.tok,
                self.parser if parse else None,
                logprobs=bool(body.get("logprobs")),
                cid=cid,
                model=self.model_name,
            )
            return await reply.run(
                request,
                generation(self.engine, req, sid),
                lambda res, content, calls: self._record(session, turn, res, content, calls),
            )
        res = await self.engine.agenerate(req, sid)
        if request.transport is None:  # the client went away meanwhile: as for a stream, nothing is recorded
            return _error("the client closed the connection", 499)
        content = self.tok.decode(res.output_ids, skip_special_tokens=True)
        calls = None
        if parse:
            parsed = self.parser.parse(content)
            content, calls = parsed.content, [c.openai() for c in parsed.calls] or None
        self._record(session, turn, res, content, calls)
        reason = tool_finish_reason(res.finish_reason, len(calls or []))
        lps = None
        if body.get("logprobs"):
            lps = {"content": token_logprobs(self.tok, res.output_ids, res.output_logprobs)}
        n = len(res.output_ids)
        return web.json_response(
            {
                "id": cid,
                "object": "chat.completion",
                "created": 0,
                "model": self.model_name,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": content, "tool_calls": calls},
                        "logprobs": lps,
                        "finish_reason": reason,
                    }
                ],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n},
            }
        )

    def _record(
        self, session: Session, turn: Turn, res: GenResult, content: str | None, calls: list[dict] | None
    ) -> None:
        """The request's turn, once its reply was written to the client (a stream's last chunk); `content` and
        `calls` as the client got them (the key under which the raw text is rendered back when the agent returns
        the message)."""
        turn.output_ids, turn.logprobs, turn.finish_reason = (
            list(res.output_ids),
            list(res.output_logprobs),
            res.finish_reason,
        )
        turn.weight_version, turn.engine = res.weight_version, res.engine
        session.turns.append(turn)
        session.raw[_message_key(content, calls)] = self.tok.decode(res.output_ids, skip_special_tokens=True)

    # ---- samples ---------------------------------------------------------------------------------------------
    def samples(self, session_id: str) -> list[Sample]:
        """The session's requests as Samples: a request whose prompt extends the current chain's tokens continues
        it (the new prompt tokens with loss mask 0, the output with mask 1), any other starts a new Sample."""
        turns = self.sessions.get(session_id, Session()).turns
        chains: list[list[int]] = []  # indices into `turns`, one list per Sample
        for k, turn in enumerate(turns):
            if chains:
                last = turns[chains[-1][-1]]
                have = last.prompt_ids + last.output_ids
                if turn.prompt_ids[: len(have)] == have:
                    chains[-1].append(k)
                    continue
            chains.append([k])
        return [self._sample(session_id, turns, chain, c) for c, chain in enumerate(chains)]

    def _sample(self, session_id: str, turns: list[Turn], chain: list[int], c: int) -> Sample:
        first, last = turns[chain[0]], turns[chain[-1]]
        traj = Trajectory()
        have = len(first.prompt_ids)
        for k in chain:
            turn = turns[k]
            traj.add_context(turn.prompt_ids[have:])
            traj.add_policy(turn.output_ids, turn.logprobs, turn.weight_version, turn.engine)
            have = len(turn.prompt_ids) + len(turn.output_ids)
        status = Status.COMPLETED if last.finish_reason == "stop" else Status.TRUNCATED
        sample = traj.fill(Sample(prompt=self.tok.decode(first.prompt_ids)), self.tok, list(first.prompt_ids), status)
        sample.metadata.update(session=session_id, chain=c)
        if self.check_fidelity:
            fidelity = sample.metadata["token_fidelity"] = self.fidelity(turns, chain[-1])
            if fidelity is not None:
                log.warning(
                    "agent proxy: session %s chain %d differs from apply_chat_template of its conversation "
                    "at token %d (trained %s, template %s)",
                    session_id,
                    c,
                    fidelity["position"],
                    fidelity["trained"],
                    fidelity["template"],
                )
        return sample

    def fidelity(self, turns: list[Turn], k: int) -> dict | None:
        """The token check of the chain that ends with request `k` (tool_rollout.first_mismatch's answer).

        A chain's tokens are its last request's prompt + output. They are compared with apply_chat_template of
        that request's conversation (its messages, with the proxy's own replies as the raw text it generated, as
        prompts are rendered) + its output. When a later request of the session went on with that conversation
        (its messages are the chain's last request's and a reply) but could not continue the tokens, e.g. because
        the agent sent the reply back re-formatted, that request's conversation is the reference (over the chain's
        length): the first token where the agent's version of the conversation departs from what is trained."""
        last = turns[k]
        trained = last.prompt_ids + last.output_ids
        later = next((t for t in turns[k + 1 :] if _continues(last.messages, t.messages)), None)
        if later is not None:
            return first_mismatch(trained, self._encode(later.text)[: len(trained)])
        return first_mismatch(trained, self._encode(last.text) + last.output_ids)

    def _encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))
