"""The agent proxy: an OpenAI-compatible `/v1/chat/completions` in front of lichen's engines that external agent
code (anything built on the `openai` SDK) drives during a rollout, while lichen records every request's prompt
tokens, output tokens and log-probs per session and turns them into Samples (docs/agentic.md#agent-proxy).

Non-streaming and streaming requests are served (a stream follows the generation when the engine has
`agenerate_stream`: lichen/rollout/agent_proxy_stream.py). Sessions are opened by lichen (`open_session()`, a
random id nobody can guess) and addressed by a per-trajectory base URL `http://HOST:PORT/sessions/<id>/v1` or by
the header `X-Session-Id` on `http://HOST:PORT/v1`; each session's requests are recorded apart.

Every local user can reach a port on 127.0.0.1, so what is recorded here is trained on only when it comes from the
agent lichen started: each request must carry the proxy's key (a fresh random one per proxy, `proxy.api_key`,
as `Authorization: Bearer KEY` — what the SDK sends for `api_key=KEY` — or `x-api-key`) and name a live session.
Anything else is refused (401 / 404, an OpenAI-style JSON error), nothing of it is recorded, and it is counted
(`proxy.refused`; `rollout/agent_proxy_refused` in a run's metrics). Request bodies are checked as `lichen serve`
checks them (lichen.engines.server.openai_api): a malformed one is a 400 naming the field, never a 500.

Token fidelity across turns:
an assistant message the proxy itself returned is rendered back as the raw text it generated, and a prompt whose
text extends the session's last prompt + output reuses those tokens (only the new suffix is encoded), so a
multi-turn conversation becomes one Sample whose policy tokens are exactly the engine's (loss mask 1, their
log-probs) and whose other tokens (tool results, templates) have loss mask 0.

    proxy = AgentProxy(engine, tokenizer)        # engine: async agenerate(GenRequest, session_id) -> GenResult
    await proxy.start()                          # on the loop the engine's agenerate runs on; proxy.url
    sid = proxy.open_session()
    ... the agent calls OpenAI(base_url=proxy.session_url(sid), api_key=proxy.api_key) ...
    proxy.close_session(sid)                     # later requests to it are refused
    samples = proxy.samples(sid)                 # one Sample per token-continuous chain of requests

With `check_fidelity=True` each Sample also gets `metadata["token_fidelity"]`: None, or the first token where it
differs from apply_chat_template of its conversation (see `AgentProxy.fidelity`).
"""

from __future__ import annotations

import json
import logging
import secrets
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from aiohttp import web

from lichen.engines.api.auth import new_key, request_has_key
from lichen.engines.api.chat_tools import template_messages, tool_mode
from lichen.engines.api.engine_protocol import AsyncEngine
from lichen.engines.api.openai_requests import apply_template, chat_messages, refuse_response_format, request_sampling
from lichen.engines.api.protocol import RequestError, bool_field, expect, int_field, loads
from lichen.engines.api.tool_parsers import ToolCallParser, load_parser, tool_finish_reason
from lichen.engines.core.engine import GenRequest, GenResult
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


# OpenAI's error types by status (the SDK raises AuthenticationError, NotFoundError, BadRequestError from them)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}
REFUSED_KEY = "agent_proxy_refused"  # Sample.metadata: requests a trajectory's proxy refused (see refused_metrics)


def _error(message: str, status: int = 400) -> web.Response:
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}, status=status
    )


def refused_metrics(samples: list[Sample]) -> dict:
    """{"rollout/agent_proxy_refused": requests refused by the agent proxies of these samples' trajectories} when
    any came through the agent proxy (each trajectory's count is on its first Sample), else {}."""
    counts = [s.metadata[REFUSED_KEY] for s in samples if isinstance((s.metadata or {}).get(REFUSED_KEY), int)]
    return {"rollout/agent_proxy_refused": sum(counts)} if counts else {}


class AgentProxy:
    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer: Any,
        *,
        parser: ToolCallParser | None = None,
        max_new_tokens: int = 1024,
        model_name: str = "lichen-policy",
        check_fidelity: bool = False,
        api_key: str | None = None,
    ):
        self.engine, self.tok = engine, tokenizer
        self.api_key = api_key or new_key()  # every request must carry it (see the module docstring)
        self.check_fidelity = check_fidelity
        self.parser = parser or load_parser("hermes")
        self.max_new_tokens, self.model_name = max_new_tokens, model_name
        self.sessions: dict[str, Session] = {}  # every session opened, live or closed (their samples stay)
        self.live: set[str] = set()  # the sessions requests may reach
        self.refused = 0  # requests refused: no or wrong key, no live session
        self.url: str | None = None
        self._runner: web.AppRunner | None = None

    # ---- sessions --------------------------------------------------------------------------------------------
    def open_session(self) -> str:
        """A new live session; its id is random (128 bits), so only who is given it can address it."""
        sid = secrets.token_urlsafe(16)
        self.sessions[sid] = Session()
        self.live.add(sid)
        return sid

    def close_session(self, session_id: str) -> None:
        """Requests to the session are refused from now on (one still generating is not recorded)."""
        self.live.discard(session_id)

    def _refuse(self, message: str, status: int) -> web.Response:
        self.refused += 1
        if self.refused == 1:  # one line, not one per request: a flood of refusals must not flood the log
            log.warning(
                "agent proxy %s: refused a request (%s); refusals are counted in the metrics", self.url, message
            )
        return _error(message, status)

    # ---- server ----------------------------------------------------------------------------------------------
    @web.middleware
    async def _guard(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        """The key before anything else is read; request errors as 400s with OpenAI's error body."""
        if not request_has_key(request.headers, self.api_key):
            return self._refuse(
                "the agent proxy needs its key: create the client with api_key=<the key lichen gave the agent> "
                "(sent as Authorization: Bearer)",
                401,
            )
        try:
            return await handler(request)
        except RequestError as e:
            return _error(e.message, e.status)
        except web.HTTPException as e:  # unknown path or method: JSON as well
            return _error(e.reason, e.status)
        except Exception as e:  # noqa: BLE001 - the engine failed: the agent gets why, the log the traceback
            log.exception("agent proxy: the request failed")
            return _error(f"the agent proxy could not answer: {type(e).__name__}: {str(e)[:500]}", 500)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        app = web.Application(middlewares=[self._guard])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/sessions/{sid}/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.url = f"http://{host}:{site._server.sockets[0].getsockname()[1]}"
        return self.url

    async def stop(self) -> None:
        self.live.clear()
        if self._runner is not None:
            await self._runner.cleanup()
        if self.refused:
            log.warning(
                "agent proxy %s refused %d request(s) (no or wrong key, no live session)", self.url, self.refused
            )

    def session_url(self, session_id: str) -> str:
        """The OpenAI base URL of one trajectory."""
        return f"{self.url}/sessions/{session_id}/v1"

    # ---- one request -----------------------------------------------------------------------------------------
    def _render(self, session: Session, messages: list[dict], tools: list[dict] | None) -> str:
        shown = []
        for m in messages:
            if m.get("role") == "assistant":
                raw = session.raw.get(_message_key(m.get("content"), m.get("tool_calls")))
                if raw is not None:  # ours: render the text the engine generated, not the parsed fields
                    m = {"role": "assistant", "content": raw}
            shown.append(m)
        return apply_template(self.tok, template_messages(shown), {"tools": tools} if tools else {})

    def _prompt_ids(self, session: Session, text: str) -> list[int]:
        if session.turns:  # continue the last turn's exact tokens when the text extends it
            last = session.turns[-1]
            history = last.prompt_ids + last.output_ids
            done = self.tok.decode(history, skip_special_tokens=False)
            if text.startswith(done):
                return history + self._encode(text[len(done) :])
        return self._encode(text)

    def _request(self, body: dict, ids: list[int]) -> GenRequest:
        """The engine request of a chat body, its sampling fields checked as `lichen serve` checks them; `max_tokens`
        is capped at the proxy's `max_new_tokens`."""
        sp = request_sampling(body, body.get("max_completion_tokens", body.get("max_tokens")))
        if sp.n != 1:
            raise RequestError(f"n must be 1 on the agent proxy (a request is one turn of one trajectory), got {sp.n}")
        if sp.stop:
            raise RequestError("stop strings are not supported by the agent proxy; leave stop out")
        if sp.max_new_tokens == 0:
            raise RequestError("max_tokens must be at least 1 on the agent proxy")
        if int_field(body, "top_logprobs", 0, ""):
            raise RequestError("top_logprobs is not supported by the agent proxy; leave it out (or 0)")
        return GenRequest(
            input_ids=ids,
            max_new_tokens=min(sp.max_new_tokens or self.max_new_tokens, self.max_new_tokens),
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            stop_token_ids=list(sp.stop_token_ids),
            seed=secrets.randbits(31) if sp.seed is None else sp.seed,
            ignore_eos=sp.ignore_eos,
        )

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        sid = request.match_info.get("sid") or request.headers.get("X-Session-Id")
        if not sid:
            return self._refuse("no session: use the base URL /sessions/<id>/v1 or send the X-Session-Id header", 404)
        if sid not in self.live:
            return self._refuse("no live session of that id (sessions are opened by lichen, one per trajectory)", 404)
        body = expect(loads(await request.read()), (dict,), "the request body", "a JSON object")
        refuse_response_format(body)
        # tool_choice as lichen serve takes it: "none" shows no tools, a forced call is refused (400)
        tools, parse = tool_mode(body, self.parser, "--tool-call-parser")
        messages = chat_messages(body)
        want_lp, stream = bool_field(body, "logprobs", False, ""), bool_field(body, "stream", False, "")
        session = self.sessions[sid]
        text = self._render(session, messages, tools)
        ids = self._prompt_ids(session, text)
        req = self._request(body, ids)
        turn = Turn(ids, [], [], "", "", "", messages, text)
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        if stream:
            reply = ReplyStream(
                self.tok,
                self.parser if parse else None,
                logprobs=want_lp,
                cid=cid,
                model=self.model_name,
            )
            return await reply.run(
                request,
                generation(self.engine, req, sid),
                lambda res, content, calls: self._record(sid, turn, res, content, calls),
            )
        res = await self.engine.agenerate(req, sid)
        if request.transport is None:  # the client went away meanwhile: as for a stream, nothing is recorded
            return _error("the client closed the connection", 499)
        content = self.tok.decode(res.output_ids, skip_special_tokens=True)
        calls = None
        if parse:
            parsed = self.parser.parse(content)
            content, calls = parsed.content, [c.openai() for c in parsed.calls] or None
        self._record(sid, turn, res, content, calls)
        reason = tool_finish_reason(res.finish_reason, len(calls or []))
        lps = None
        if want_lp:
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

    def _record(self, sid: str, turn: Turn, res: GenResult, content: str | None, calls: list[dict] | None) -> None:
        """The request's turn, once its reply was written to the client (a stream's last chunk); `content` and
        `calls` as the client got them (the key under which the raw text is rendered back when the agent returns
        the message). Nothing when the session was closed meanwhile: its samples may already be taken."""
        if sid not in self.live:
            return
        session = self.sessions[sid]
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
