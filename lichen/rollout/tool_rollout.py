"""The built-in multi-turn tool rollout: `--tool-paths MODULE.FN ...` (which selects it) or
`--custom-generate-function-path lichen.rollout.tool_rollout.generate` (docs/agentic.md).

One trajectory, turn by turn:
1. the prompt is rendered by the chat template with the tools' schemas (so the policy sees them);
2. the engine continues the exact token history (prompt + every earlier turn's tokens) with the response budget
   left; the policy's tokens are kept as the engine returned them, with their rollout log-probs and loss mask 1;
3. the turn's text is parsed for calls (--tool-call-parser); without a complete call, or when the engine stopped on
   the length limit, the trajectory ends (completed on a stop token, truncated on the budget). A closed block that
   is not a valid call (bad JSON, no name, over the parser's size/depth limits: docs/serving.md) is a failed call:
   its tool message is an 'error: invalid tool call: ...' text the policy reads, and the trajectory goes on;
4. each call runs (async or in a thread, --tool-timeout; failures become 'error: ...' text the policy reads),
   and the tool messages are appended as the chat template's tokens for them (the text between the end of an
   assistant message and the next assistant generation prompt), with loss mask 0 and log-prob 0.0: fed to the
   model, never trained on. The response budget (--rollout-max-response-len) counts them too.
At most --max-turns engine calls. Turn t samples with the sample's seed (t = 0) or derive_seed(seed, t).
The generated text is decoded only to parse calls and to fill the conversation: no turn is re-encoded.

Rewards see the whole trajectory: `sample.response` (every turn's and tool's text), and in `sample.metadata`:
`messages` (the conversation: prompt messages, assistant turns, tool messages), `tool_calls` (name, arguments,
result per call; name and arguments None for a malformed call), `turns`, `stop` ("answer", "max_turns" or "budget"). With --check-token-fidelity each turn's
input is compared with apply_chat_template of the same conversation; `metadata["token_fidelity"]` is None when all
agree, else the first mismatching position and tokens.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from lichen.config.tool_config import ToolConfig
from lichen.engines.api.tool_parsers import ParsedOutput, ToolCall, load_parser
from lichen.engines.core.sampler import derive_seed
from lichen.models.tokenizer import encode_prompt
from lichen.rollout.custom_generate import current
from lichen.rollout.tools import Tool, load_tools, run_tool
from lichen.rollout.trajectory import Trajectory
from lichen.types import Sample, Status

log = logging.getLogger(__name__)
_ANCHOR = [{"role": "user", "content": "u"}]
_CACHE: dict[ToolConfig, tuple[dict[str, Tool], Any]] = {}


def _setup(cfg: ToolConfig) -> tuple[dict[str, Tool], Any]:
    if cfg not in _CACHE:
        _CACHE[cfg] = (load_tools(cfg.tool_paths), load_parser(cfg.parser, "--tool-call-parser"))
    return _CACHE[cfg]


def _render(tok, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
    kwargs = {"tools": tools} if tools else {}
    text = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False, **kwargs)
    return text[0] if isinstance(text, list) else text


def tool_turn_ids(tok, tool_messages: list[dict], ended_with: str | None) -> list[int]:
    """The template's tokens from the end of an assistant message's content to the next assistant generation
    prompt, with `tool_messages` between. `ended_with` is the text of the stop token the engine ended the turn
    with (it is in the trajectory already, so not added twice when the template closes the turn with it)."""
    head = _render(tok, _ANCHOR, None, True) + "a"
    full = _render(tok, [*_ANCHOR, {"role": "assistant", "content": "a"}, *tool_messages], None, True)
    if not full.startswith(head):
        raise ValueError(
            "the chat template renders an assistant message differently from its generation prompt "
            "followed by the content; the tool rollout cannot place tool messages after a turn"
        )
    ids = list(tok.encode(full[len(head) :], add_special_tokens=False))
    # dropped only when the template's first tokens ARE the stop token: a plain-character stop (e.g. "<") that is
    # merely the first character of the template's closing text (`<|im_end|>`) must not eat that token's text
    ended = list(tok.encode(ended_with, add_special_tokens=False)) if ended_with else []
    return ids[len(ended) :] if ended and ids[: len(ended)] == ended else ids


def first_mismatch(trained: list[int], reference: list[int]) -> dict | None:
    """None when `trained` == `reference`, else the first position where they differ (and the tokens there)."""
    for k, (a, b) in enumerate(zip(trained, reference)):
        if a != b:
            return {"position": k, "trained": a, "template": b}
    if len(trained) != len(reference):
        k = min(len(trained), len(reference))
        return {
            "position": k,
            "trained": trained[k] if k < len(trained) else None,
            "template": reference[k] if k < len(reference) else None,
        }
    return None


def check_turn(tok, messages: list[dict], tools: list[dict] | None, trained: list[int]) -> dict | None:
    """Compare the token history a turn starts from with apply_chat_template of the same conversation."""
    reference = list(tok.encode(_render(tok, messages, tools, True), add_special_tokens=False))
    return first_mismatch(trained, reference)


CALL_FORMAT = 'write one JSON object {"name": ..., "arguments": {...}} per <tool_call></tool_call> block'


def parse_turn(parser: Any, text: str, index: int) -> ParsedOutput:
    """The turn's calls and malformed blocks. A parser that raises (a plug-in's bug on hostile text) fails the
    turn's calls, not the run: the model is told, as for a malformed call."""
    try:
        return parser.parse(text)
    except Exception as e:  # noqa: BLE001 - model text must never end the run (RecursionError included)
        log.warning(
            "tool rollout: sample %d: the tool-call parser failed: %s: %s", index, type(e).__name__, str(e)[:200]
        )
        return ParsedOutput(text.strip() or None, [], ["the tool-call parser could not read this turn"])


def _prompt_messages(prompt: Any) -> list[dict]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]


async def generate(args: Any, sample: Sample, sampling_params: dict) -> Sample:
    """The custom generate function (see the module docstring)."""
    cfg = ToolConfig.from_args(args)
    tools, parser = _setup(cfg)
    ctx = current()
    tok = ctx.tokenizer
    schemas = [t.schema for t in tools.values()] or None
    messages = _prompt_messages(sample.prompt)
    prompt = encode_prompt(tok, sample.prompt, True, tools=schemas)
    budget = int(sampling_params["max_new_tokens"])
    seed = int(sampling_params["sampling_seed"])
    traj = Trajectory()
    calls_made: list[dict] = []
    status, stop, fidelity, turns = Status.TRUNCATED, "max_turns", None, 0
    for turn in range(cfg.max_turns):
        if budget <= 0:
            stop = "budget"
            break
        if cfg.check_fidelity and fidelity is None:
            fidelity = check_turn(tok, messages, schemas, prompt + traj.tokens)
        params = {
            **sampling_params,
            "max_new_tokens": budget,
            "sampling_seed": seed if turn == 0 else derive_seed(seed, turn),
        }
        res = await ctx.generate(prompt + traj.tokens, params, session_id=f"tools-{seed}")
        turns += 1
        traj.add_policy(res.output_ids, res.output_logprobs, res.weight_version, res.engine)
        budget -= len(res.output_ids)
        text = tok.decode(res.output_ids, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": text})
        parsed = parse_turn(parser, text, sample.index)
        malformed = getattr(parsed, "malformed", [])  # a plug-in's own output type may not have it
        if not (parsed.calls or malformed) or res.finish_reason != "stop":
            status = Status.COMPLETED if res.finish_reason == "stop" else Status.TRUNCATED
            stop = "answer" if res.finish_reason == "stop" else "budget"
            break
        results = await asyncio.gather(*(run_tool(tools, c.name, c.arguments, cfg.timeout) for c in parsed.calls))
        tool_messages = []
        for c, r in zip(parsed.calls, results):
            calls_made.append({"turn": turn, "name": c.name, "arguments": c.arguments, "result": r})
            tool_messages.append({"role": "tool", "name": c.name, "tool_call_id": c.id, "content": r})
        for reason in malformed:  # a failed call: the model reads why, the trajectory goes on
            r = f"error: invalid tool call: {reason}; {CALL_FORMAT}"
            calls_made.append({"turn": turn, "name": None, "arguments": None, "result": r})
            tool_messages.append({"role": "tool", "name": "invalid", "tool_call_id": ToolCall("", "").id, "content": r})
        messages += tool_messages
        ended = tok.decode(res.output_ids[-1:], skip_special_tokens=False) if res.output_ids else None
        tool_ids = tool_turn_ids(tok, tool_messages, ended)[: max(budget, 0)]
        traj.add_context(tool_ids)
        budget -= len(tool_ids)
        if budget <= 0:
            stop = "budget"
            break
    if fidelity is not None:
        log.warning(
            "tool rollout: sample %d differs from apply_chat_template of its conversation at token %d "
            "(trained %s, template %s)",
            sample.index,
            fidelity["position"],
            fidelity["trained"],
            fidelity["template"],
        )
    traj.fill(sample, tok, prompt, status)
    sample.metadata.update(messages=messages, tool_calls=calls_made, turns=turns, stop=stop)
    if cfg.check_fidelity:
        sample.metadata["token_fidelity"] = fidelity
    return sample
