"""The multi-turn tool rollout over a scripted engine (shared by the tool-rollout tests): tools named by dotted
path, the rollout's arguments, an engine whose turns are given token lists, and one rollout of a sample."""

from __future__ import annotations

import argparse
import asyncio

from lichen.engines.core.engine import GenResult
from lichen.rollout.custom_generate import run_custom_generate
from lichen.rollout.tool_rollout import generate
from lichen.types import Sample


# ---- tools the tests name by dotted path ---------------------------------------------------------------------------
def add(a: int, b: int = 0) -> int:
    """Add two integers."""
    return a + b


async def slow(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return "woke"


def boom() -> str:
    raise RuntimeError("tool broke")


boom.schema = {"name": "boom", "description": "always fails", "parameters": {"type": "object", "properties": {}}}


def tool_args(**kw) -> argparse.Namespace:
    base = dict(
        tool_paths=["helpers.tool_rollout.add", "helpers.tool_rollout.slow", "helpers.tool_rollout.boom"],
        max_turns=4,
        tool_timeout=5.0,
        tool_call_parser="hermes",
        check_token_fidelity=True,
        agent_function_path=None,
        seed=5,
        rollout_stop_token_ids=None,
        custom_generate_function_path="lichen.rollout.tool_rollout.generate",
    )
    return argparse.Namespace(**{**base, **kw})


class ScriptedEngine:
    """An async engine whose turns are given token lists; records every request."""

    def __init__(self, turns: list[list[int]], stop_id: int):
        self.turns, self.stop_id, self.requests = list(turns), stop_id, []

    async def agenerate(self, r, session_id=None):
        self.requests.append(r)
        ids = self.turns.pop(0)[: r.max_new_tokens]
        reason = "stop" if ids and ids[-1] == self.stop_id else "length"
        server = f"http://127.0.0.1:{9000 + len(self.requests) % 2}"  # turns alternate between two servers
        return GenResult(ids, [-0.1 * (k + 1) for k in range(len(ids))], reason, len(r.input_ids), "7", server)


def enc(tok, s):
    return list(tok.encode(s, add_special_tokens=False))


def rollout(tok, turns, budget=400, **kw):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    engine = ScriptedEngine(turns, im_end)
    sample = Sample(prompt="what is 1+2?", tokens=[1], index=0)
    [out] = run_custom_generate(
        generate,
        tool_args(**kw),
        [sample],
        [{"max_new_tokens": budget, "sampling_seed": 11}],
        engine=engine,
        tokenizer=tok,
    )
    return out, engine
