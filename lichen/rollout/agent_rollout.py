"""`--agent-function-path MODULE.FN`: an external agent, written against the `openai` SDK, as the rollout's
generate function (docs/agentic.md#agent-rollout).

    async def my_agent(base_url: str, sample: Sample, api_key: str) -> None:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
        ...   # any number of chat.completions.create calls, tools run by the agent itself

For each sample lichen serves an agent proxy (lichen/rollout/agent_proxy.py) on loopback, hands the agent the
base URL of a session of its own (a random id) and the proxy's key (random, per proxy: requests without it, or
outside the session, are refused and counted in `metadata["agent_proxy_refused"]` of the trajectory's first
Sample, summed as `rollout/agent_proxy_refused`), and returns the session's requests as Samples (one per token-continuous chain;
several chains all join the prompt's group). The agent's requests are sampled with the rollout's settings
(--rollout-temperature, top-p, top-k, and a seed derived from the sample's, one per request), whatever the agent
asks for, so log-probs follow the training convention; each request generates at most the sample's response
budget (--rollout-max-response-len); a `stream=True` request streams from the rollout's engine as it generates.
Use the async client: a blocking call would stall every other trajectory.
With --check-token-fidelity each Sample gets metadata["token_fidelity"] (AgentProxy.fidelity).
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from lichen.config.tool_config import ToolConfig
from lichen.engines.api.tool_parsers import load_parser
from lichen.engines.core.engine import GenRequest, GenResult
from lichen.engines.core.sampler import derive_seed
from lichen.plugins import load_function
from lichen.rollout.agent_proxy import REFUSED_KEY, AgentProxy
from lichen.rollout.agent_proxy_stream import generation
from lichen.rollout.custom_generate import GenerateContext, current, request_from_params
from lichen.types import Sample, Status

FLAG = "--agent-function-path"


class _RolloutEngine:
    """The proxy's engine: the rollout's engine, with the rollout's sampling settings for every request."""

    def __init__(self, ctx: GenerateContext):
        self.ctx = ctx
        self.params: dict[str, dict] = {}  # session -> the sample's sampling_params
        self.count: dict[str, int] = {}

    def _request(self, request: GenRequest, session_id: str) -> GenRequest:
        params = self.params[session_id]
        k = self.count[session_id] = self.count.get(session_id, 0) + 1
        seed = int(params["sampling_seed"])
        return request_from_params(
            request.input_ids,
            {
                **params,
                "max_new_tokens": max(1, min(request.max_new_tokens, int(params["max_new_tokens"]))),
                "sampling_seed": seed if k == 1 else derive_seed(seed, k - 1),
            },
        )

    async def agenerate(self, request: GenRequest, session_id: str | None = None) -> GenResult:
        return await self.ctx.engine.agenerate(self._request(request, session_id), session_id)

    def agenerate_stream(self, request: GenRequest, session_id: str | None = None) -> AsyncIterator[GenResult]:
        return generation(self.ctx.engine, self._request(request, session_id), session_id)


async def generate(args: Any, sample: Sample, sampling_params: dict) -> list[Sample]:
    """The custom generate function (see the module docstring)."""
    cfg = ToolConfig.from_args(args)
    agent = load_function(cfg.agent_path, FLAG)
    engine = _RolloutEngine(current())
    proxy = AgentProxy(
        engine,
        current().tokenizer,
        parser=load_parser(cfg.parser, "--tool-call-parser"),
        check_fidelity=cfg.check_fidelity,
    )
    await proxy.start()  # one per trajectory: its key, sessions and sockets end with it
    sid = proxy.open_session()
    engine.params[sid] = sampling_params
    try:
        await agent(proxy.session_url(sid), sample, api_key=proxy.api_key)
    finally:
        await proxy.stop()
    out = proxy.samples(sid)
    if not out:  # the agent never called the model: nothing to train on
        sample.status, sample.response_length = Status.FAILED, 0
        sample.metadata.update(agent="no request", **{REFUSED_KEY: proxy.refused})
        return [sample]
    for k, s in enumerate(out):
        s.prompt, s.label, s.index = sample.prompt, sample.label, sample.index
        # the trajectory's count once, on its first Sample, so summing over samples counts each request once
        s.metadata = {**sample.metadata, **s.metadata, REFUSED_KEY: proxy.refused if k == 0 else 0}
    return out
