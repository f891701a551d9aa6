"""Multi-turn tool use with a calculator: an example `--custom-generate-function-path`.

    lichen train ... --custom-generate-function-path lichen.rollout.examples.calculator_agent.generate

The policy may write a call `<calc>EXPR</calc>` anywhere in its answer; EXPR is arithmetic on numbers with
+ - * / // % ** and parentheses. One turn:
1. the engine continues the trajectory (prompt + everything so far) with the remaining token budget;
2. if the new text contains a complete call, the turn is cut right after `</calc>` (as a stop string would cut
   it: later tokens are dropped), the calculator runs, and `<result>VALUE</result>` (or `<result>error: ...</result>`)
   is appended as tokens the policy did not produce: loss_mask 0 and rollout log-prob 0.0, so they are fed to the
   model but never trained on;
3. otherwise the answer is finished: completed on EOS / a stop token, truncated when the budget ran out.
At most MAX_TURNS engine calls; every response token, the policy's and the tool's, counts against
--rollout-max-response-len. Turn t samples with seed derive_seed(sampling_seed, t) for t > 0 and with the
sample's own seed for t = 0, so a trajectory without a call is exactly the default rollout's sample. The tool's
tokens are appended as ids, not re-tokenized with the text around them, so training sees exactly the tokens the
policy was conditioned on. metadata["tool_calls"] counts the calls.
"""

from __future__ import annotations

import ast
import math
import operator

from lichen.engines.core.sampler import derive_seed
from lichen.rollout.custom_generate import current
from lichen.rollout.trajectory import Trajectory
from lichen.types import Sample, Status

CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
MAX_TURNS = 4
_MAX_POWER = 64  # keeps `9**9**9` from taking the machine down
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculate(expr: str) -> str:
    """The value of an arithmetic expression as text (integers without a decimal point), or 'error: ...'."""

    def ev(node: ast.AST):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > _MAX_POWER:
                raise ValueError("exponent too large")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        raise ValueError("only numbers, + - * / // % ** and parentheses are allowed")

    try:
        value = ev(ast.parse(expr.strip(), mode="eval"))
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, TypeError, OverflowError) as e:
        return f"error: {e.msg if isinstance(e, SyntaxError) else e}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "error: not a finite number"
        if value.is_integer():
            value = int(value)
    return str(value)


def find_call(tokenizer, output_ids: list[int]) -> tuple[int, str] | None:
    """(k, EXPR) where output_ids[:k] ends with the first complete `<calc>EXPR</calc>`, or None."""
    text = tokenizer.decode(output_ids, skip_special_tokens=True)
    end = text.find(CALL_CLOSE)
    if end < 0:
        return None
    start = text.rfind(CALL_OPEN, 0, end)
    if start < 0:
        return None
    expr = text[start + len(CALL_OPEN) : end]
    for k in range(1, len(output_ids) + 1):  # the fewest tokens whose text holds the whole call
        if CALL_CLOSE in tokenizer.decode(output_ids[:k], skip_special_tokens=True):
            return k, expr
    return None


async def generate(args, sample: Sample, sampling_params: dict) -> Sample:
    """The custom generate function (see the module docstring)."""
    ctx = current()
    tok = ctx.tokenizer
    prompt = list(sample.tokens)
    budget = int(sampling_params["max_new_tokens"])
    seed = int(sampling_params["sampling_seed"])
    traj = Trajectory()
    calls = 0
    status = Status.TRUNCATED
    for turn in range(MAX_TURNS):
        if budget <= 0:
            break
        params = {
            **sampling_params,
            "max_new_tokens": budget,
            "sampling_seed": seed if turn == 0 else derive_seed(seed, turn),
        }
        res = await ctx.generate(prompt + traj.tokens, params, session_id=f"calc-{seed}")
        call = find_call(tok, res.output_ids)
        if call is None:
            traj.add_policy(res.output_ids, res.output_logprobs, res.weight_version, res.engine)
            status = Status.COMPLETED if res.finish_reason == "stop" else Status.TRUNCATED
            break
        k, expr = call
        calls += 1
        traj.add_policy(res.output_ids[:k], res.output_logprobs[:k], res.weight_version, res.engine)
        budget -= k
        tool = tok.encode(f"{RESULT_OPEN}{calculate(expr)}{RESULT_CLOSE}", add_special_tokens=False)[: max(budget, 0)]
        traj.add_context(tool)
        budget -= len(tool)
    traj.fill(sample, tok, prompt, status)
    sample.metadata["tool_calls"] = calls
    return sample
