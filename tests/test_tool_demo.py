"""The agentic demo's pieces (examples/agentic_calculator.py, docs/agentic.md#demo): the SFT traces are what the
tool rollout would produce (the template's conversation, tool turn masked), the call parser and the reward."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import agentic_calculator as demo  # noqa: E402
import agentic_calculator_demo as driver  # noqa: E402

from lichen.models.tokenizer import load_tokenizer  # noqa: E402
from lichen.rollout.tool_rollout import check_turn  # noqa: E402


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return load_tokenizer(tiny_ckpt)


def test_sft_trace_is_the_tool_rollouts_conversation_with_the_tool_turn_masked(tok):
    prompt, traj = demo.tool_trace(tok, "4821+3107=", "7928")
    schemas = [{"type": "function", "function": demo.calc.schema}]
    call_len = traj.mask.index(0)
    tool_len = traj.mask[call_len:].index(1)
    call, tool, answer = (
        traj.tokens[:call_len],
        traj.tokens[call_len : call_len + tool_len],
        traj.tokens[call_len + tool_len :],
    )
    assert tok.decode(call) == "<calc>4821+3107</calc><|im_end|>" and tok.decode(answer) == "7928<|im_end|>"
    assert tok.decode(tool) == "\n<|im_start|>tool\n7928<|im_end|>\n<|im_start|>assistant\n"
    assert traj.mask == [1] * call_len + [0] * tool_len + [1] * len(answer)
    # the fidelity check of the tool rollout finds the trace's second turn equal to the template's rendering
    messages = [
        {"role": "user", "content": "4821+3107="},
        {"role": "assistant", "content": "<calc>4821+3107</calc>"},
        {"role": "tool", "name": "calc", "content": "7928"},
    ]
    assert check_turn(tok, messages, schemas, prompt + call + tool) is None
    assert check_turn(tok, messages[:1], schemas, prompt) is None


def test_cold_start_mix_answers_from_memory_or_calls_the_tool(tok):
    prompt, traj = demo.direct_trace(tok, "4821+3107=", "7928")
    tool_prompt, _ = demo.tool_trace(tok, "4821+3107=", "7928")
    assert prompt == tool_prompt  # the same prompt, tool schema included: only the policy's choice differs
    assert tok.decode(traj.tokens) == "7928<|im_end|>" and traj.mask == [1] * len(traj.tokens)
    pick = demo.cold_start_trace
    assert pick(types.SimpleNamespace(metadata={"sft_trace": "direct"})) is demo.direct_trace
    assert pick(types.SimpleNamespace(metadata={"sft_trace": "tool"})) is demo.tool_trace
    assert pick(types.SimpleNamespace(metadata=None)) is demo.tool_trace


@pytest.mark.parametrize(
    "flags", [["--mix-tool-fraction", "1.5"], ["--mix-tool-fraction", "-0.1"], ["--mix-steps", "-1"]]
)
def test_bad_cold_start_flags_are_usage_errors(flags, capsys):
    with pytest.raises(SystemExit) as e:
        driver.parse_args(flags)
    assert e.value.code == 2 and flags[0] in capsys.readouterr().err


def test_parser_and_reward():
    parsed = demo.CalcParser().parse("ok <calc>12+3</calc>")
    assert parsed.content == "ok" and [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("calc", {"expr": "12+3"})
    ]
    assert demo.CalcParser().parse("7928").calls == [] and demo.calc("4821+3107") == "7928"

    def sample(stop, last, label="7928"):
        msgs = [
            {"role": "user", "content": "4821+3107="},
            {"role": "assistant", "content": "<calc>4821+3107</calc>"},
            {"role": "tool", "content": "7928"},
            {"role": "assistant", "content": last},
        ]
        return types.SimpleNamespace(metadata={"messages": msgs, "stop": stop}, response="", label=label)

    assert demo.reward(None, sample("answer", "7928")) == 1.0
    assert demo.reward(None, sample("answer", "7929")) == 0.0
    assert demo.reward(None, sample("budget", "7928")) == 0.0  # cut off: no final answer
    assert demo.reward(None, types.SimpleNamespace(metadata={}, response=" 7928", label="7928")) == 1.0


def test_sft_early_stop_rule_is_the_first_eval_reaching_the_target(tmp_path):
    assert driver.stop_step([(25, 0.0), (50, 0.39), (75, 0.4), (100, 0.9)], 0.4) == 75
    assert driver.stop_step([(25, 0.0), (50, 0.1)], 0.4) is None
    metrics = tmp_path / "metrics.jsonl"
    rows = [
        {"step": 25, "eval/sft_eval/reward_mean": 0.2},
        {"step": 26, "loss": 1.0},
        {"step": 50, "eval/sft_eval/reward_mean": 0.5},
        {"step": 50, "eval/heldout/reward_mean": 0.9},
    ]
    stop = driver.EarlyStop(str(metrics), 0.4)
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    assert not stop("step 25/100 | loss 1.0 | eval sft_eval 0.200") and stop.step is None
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert not stop("step 50/100 | loss 1.0")  # only eval lines are looked at
    assert stop("step 50/100 | loss 1.0 | eval sft_eval 0.500") and stop.step == 50  # the test set is not read


def test_data_splits_share_no_problem(tmp_path):
    args = driver.parse_args(["--seed", "3", "--train-problems", "300", "--heldout", "40", "--sft-eval-problems", "30"])
    paths = driver.make_data(args, str(tmp_path))
    rows = [[json.loads(line) for line in Path(p).read_text().splitlines()] for p in paths]
    assert [len(r) for r in rows] == [300, 40, 30]
    prompts = [{r["prompt"] for r in split} for split in rows]
    assert sum(map(len, prompts)) == len(set().union(*prompts)) == 370
    assert all(eval(r["prompt"].rstrip("=")) == int(r["label"]) for split in rows for r in split)
    kinds = [r["metadata"]["sft_trace"] for r in rows[0]]  # the cold-start mix: drawn per training problem
    assert 0.4 < kinds.count("tool") / 300 < 0.6 and set(kinds) == {"tool", "direct"}
    assert all("metadata" not in r for split in rows[1:] for r in split)  # test and SFT-eval rows: plain
    all_tool = driver.parse_args(
        [
            "--seed",
            "3",
            "--train-problems",
            "300",
            "--heldout",
            "40",
            "--sft-eval-problems",
            "30",
            "--mix-tool-fraction",
            "1",
        ]
    )
    paths = driver.make_data(all_tool, str(tmp_path / "all_tool"))
    again = [json.loads(line) for line in Path(paths[0]).read_text().splitlines()]
    assert [r["prompt"] for r in again] == [r["prompt"] for r in rows[0]]  # the fraction does not move the splits
    assert {r["metadata"]["sft_trace"] for r in again} == {"tool"}


@pytest.mark.slow
def test_tiny_run_starts_rl_from_the_cold_start_mix_after_sft_stopped(tmp_path):
    """The whole script on a tiny budget: with a target of 0% SFT stops at its first eval (step 2 of at most 40),
    the run is cut there, the cold-start mix continues from that step's checkpoint and RL loads the mix's."""
    import subprocess

    script = os.path.join(os.path.dirname(demo.__file__), "agentic_calculator.py")
    r = subprocess.run(
        [
            sys.executable,
            script,
            "--seed",
            "2",
            "--workdir",
            str(tmp_path),
            "--quiet",
            "--arms",
            "tool",
            "--train-problems",
            "100",
            "--heldout",
            "4",
            "--sft-eval-problems",
            "4",
            "--sft-steps",
            "40",
            "--sft-eval-every",
            "2",
            "--sft-batch",
            "4",
            "--sft-stop-accuracy",
            "0",
            "--mix-steps",
            "3",
            "--rl-steps",
            "1",
            "--rl-prompts",
            "2",
            "--rl-group",
            "2",
            "--rl-eval-every",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    tool = json.loads((tmp_path / "seed2" / "summary.json").read_text())["arms"]["tool"]
    assert tool["sft_steps"] == 2 and tool["sft_stopped_early"] and tool["sft_eval_curve"] == [[2, 0.0]]
    mix = json.loads((tmp_path / "seed2" / "tool_mix" / "config.json").read_text())
    assert mix["hf_checkpoint"].endswith(os.path.join("tool_sft", "checkpoints", "iter_0000001", "hf"))
    assert mix["rollout_function_path"] == "agentic_calculator.mixed_sft_rollout"
    config = json.loads((tmp_path / "seed2" / "tool_rl" / "config.json").read_text())
    assert config["hf_checkpoint"].endswith(os.path.join("tool_mix", "checkpoints", "iter_0000002", "hf"))
    assert tool["trajectories"] == 4
    assert [step for step, _ in tool["heldout_tool_call_curve"]] == [0, 1]
    assert len(tool["rollout_tool_call_ratio"]) == 1
    assert "held-out answers that called the tool" in r.stdout
