"""Agentic RL demo: a tiny model that can use a calculator but often does not learns by RL to use it.

    .venv/bin/python examples/agentic_calculator.py [--seed 1] [--workdir runs/agentic] [--quiet]
    for s in 1 2 3 4 5; do .venv/bin/python examples/agentic_calculator.py --seed $s --quiet; done

The task is "4821+3907=" -> "8728" (operands of --digits digits). A 2-layer model of width 64 does not learn
4-digit addition in a few minutes; with a calculator it only has to copy: call the tool with the expression and
copy its result. Two arms from the same random-init model, each stage a plain `lichen` command run as a child
process:

  tool     1. SFT on tool-using traces (`sft_rollout`): the policy writes `<calc>4821+3907</calc>` (a parser
              plug-in, `--tool-call-parser agentic_calculator.CalcParser`), the chat template's tool turn holds the
              result (loss mask 0), the policy writes the answer -- exactly the tokens the RL rollout will produce.
              Copying is the slow skill, so this stage runs until the model copies (below).
           2. SFT on a cold-start mix (`mixed_sft_rollout`, --mix-steps): on a --mix-tool-fraction of the problems
              the trace calls the tool, on the rest it answers from memory, as a corpus gathered from a model that
              used its tool only sometimes. The model keeps the skill but mostly answers from memory: the situation
              agentic RL is used for (the policy can use its tools and does not yet know that they pay).
           3. GRPO with the built-in multi-turn tool rollout (`--tool-paths agentic_calculator.calc`) and
              --check-token-fidelity.
  no tool  SFT on direct answers ("8728") under the same stopping rule (--sft-steps when never reached), then GRPO
           with the same budget, no tools.

When stage 1 stops (one rule for every seed and both arms): every --sft-eval-every steps SFT evaluates greedy
accuracy on an SFT-eval split (apart from the training and test problems) and saves a checkpoint; the first eval
that reaches --sft-stop-accuracy ends the SFT run (else it runs --sft-steps). Tool SFT sits on a plateau that
breaks at a different step on each seed, so a fixed step count would leave some seeds unable to copy.

Reward (`reward`): 1 iff the leading integer of the final assistant message is the sum (the tool arm's reward
sees the whole trajectory through metadata["messages"]; an answer cut off by the budget or --max-turns gets 0).
Held-out accuracy (greedy, --heldout problems never trained on) and the share of held-out answers that called the
tool are evaluated before RL -- the SFT model -- and every --rl-eval-every GRPO steps. The demo also counts, over
every trajectory the tool arm's RL trained on, those whose token history differs from apply_chat_template of
their conversation (the fidelity check: the trained tokens are the engine's plus the template's tool turns,
nothing re-encoded; a special token the policy samples shows up as one, as its text is dropped when decoded).

Prints per arm the held-out accuracy after SFT and after RL, the tool-call rates, the fidelity result and the wall
(and CPU) time; writes <workdir>/seed<N>/summary.json; exits 1 when a stage fails. Success criteria of issue 21:
the tool arm gains >= 10 points over its SFT start and ends above the no-tool arm.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

EVAL_NAME = "heldout"  # the test set's name in metrics.jsonl (quickstart.eval_curve reads it)
SFT_EVAL_NAME = "sft_eval"  # the split SFT's early stop reads (never the test set)
TOOL = "agentic_calculator.calc"
PARSER = "agentic_calculator.CalcParser"
_LEADING_INT = re.compile(r"\s*(-?\d+)")

# ---------------------------------------------------------------------------------- plug-ins the runs load


def calc(expr: str) -> str:
    """Evaluate an arithmetic expression."""
    from lichen.rollout.examples.calculator_agent import calculate

    return calculate(expr)


# short (the template shows it in every prompt, and a tiny model pays for every token)
calc.schema = {"name": "calc", "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}


def final_answer(sample: Any) -> str:
    """The text of the last assistant message (the tool rollout's conversation), or the response."""
    messages = (sample.metadata or {}).get("messages")
    if messages is None:
        return sample.response or ""
    if sample.metadata.get("stop") != "answer":  # cut off by the budget or --max-turns: no final answer
        return ""
    return next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")


def reward(args: Any, sample: Any) -> float:
    m = _LEADING_INT.match(final_answer(sample))
    return 1.0 if m is not None and int(m.group(1)) == int(sample.label) else 0.0


def call_text(expr: str) -> str:
    return f"<calc>{expr}</calc>"


class CalcParser:
    """A --tool-call-parser plug-in for the compact call format `<calc>EXPR</calc>` (a tiny model copies the
    expression more easily across a short call than across Hermes' JSON; the tool rollout is the same)."""

    _CALL = re.compile(r"<calc>(.*?)</calc>", re.S)

    def parse(self, text: str) -> Any:
        from lichen.engines.api.tool_parsers import ParsedOutput, ToolCall

        calls = [ToolCall("calc", json.dumps({"expr": m.group(1)})) for m in self._CALL.finditer(text)]
        content = self._CALL.sub("", text).strip()
        return ParsedOutput(content or None, calls)

    def stream(self) -> Any:
        raise NotImplementedError("the demo's parser serves the tool rollout only, which does not stream")


def _prompt_ids(tok: Any, prompt: str) -> list[int]:
    """The prompt as the tool rollout renders it: the user message with the tool's schema shown."""
    from lichen.models.tokenizer import encode_prompt

    return encode_prompt(tok, prompt, True, tools=[{"type": "function", "function": calc.schema}])


def _turn(tok: Any, text: str) -> list[int]:
    """An assistant turn's policy tokens: the text, then <|im_end|>."""
    return list(tok.encode(text, add_special_tokens=False)) + [tok.convert_tokens_to_ids("<|im_end|>")]


def tool_trace(tok: Any, prompt: str, label: str, version: str = "") -> tuple[list[int], Any]:
    """(prompt ids, Trajectory) of one tool-using trace, built as the tool rollout builds a trajectory: the prompt
    rendered with the tool's schema, the call and the answer as policy tokens (loss mask 1), the chat template's
    tool turn with the calculator's result between them (loss mask 0)."""
    from lichen.rollout.tool_rollout import tool_turn_ids
    from lichen.rollout.trajectory import Trajectory

    expr = prompt.rstrip("=")
    call, answer = _turn(tok, call_text(expr)), _turn(tok, str(label))
    traj = Trajectory()
    traj.add_policy(call, [0.0] * len(call), version)
    traj.add_context(tool_turn_ids(tok, [{"role": "tool", "name": "calc", "content": calc(expr)}], "<|im_end|>"))
    traj.add_policy(answer, [0.0] * len(answer), version)
    return _prompt_ids(tok, prompt), traj


def direct_trace(tok: Any, prompt: str, label: str, version: str = "") -> tuple[list[int], Any]:
    """(prompt ids, Trajectory) of a trace that answers from memory: the same prompt (the tool's schema shown), the
    answer as policy tokens."""
    from lichen.rollout.trajectory import Trajectory

    answer = _turn(tok, str(label))
    traj = Trajectory()
    traj.add_policy(answer, [0.0] * len(answer), version)
    return _prompt_ids(tok, prompt), traj


def _supervised(args: Any, rollout_id: int, data_source: Any, evaluation: bool, trace: Any) -> Any:
    from lichen.rollout.base_types import RolloutFnTrainOutput
    from lichen.rollout.context import current
    from lichen.rollout.eval import eval_rollout
    from lichen.types import Status

    if evaluation:
        return eval_rollout(args, rollout_id, data_source)
    ctx = current()
    groups = data_source.get_samples(ctx.config.data.batch_size)
    for group in groups:
        for s in group:
            ids, traj = trace(s)(ctx.tokenizer, str(s.prompt), str(s.label), ctx.engine.weight_version)
            traj.fill(s, ctx.tokenizer, ids, Status.COMPLETED)
            s.reward = None  # supervised: nothing is scored
    return RolloutFnTrainOutput(groups)


def sft_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """SFT on tool-using traces (a --rollout-function-path; see `tool_trace`); evaluation is lichen's own."""
    return _supervised(args, rollout_id, data_source, evaluation, lambda s: tool_trace)


def mixed_sft_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """SFT on the cold-start mix: each training row's metadata["sft_trace"] ("tool" or "direct", drawn by
    `make_data`) picks `tool_trace` or `direct_trace`."""
    return _supervised(args, rollout_id, data_source, evaluation, cold_start_trace)


def cold_start_trace(sample: Any) -> Any:
    """The trace builder of a training row in the cold-start mix (its metadata["sft_trace"])."""
    return direct_trace if (sample.metadata or {}).get("sft_trace") == "direct" else tool_trace


if __name__ == "__main__":  # the demo's stages and report: agentic_calculator_demo.py
    from agentic_calculator_demo import main

    sys.exit(main())
