"""--rollout-max-context-len: every sample fits the model's positions, with the same per-sample budget
min(--rollout-max-response-len, context - prompt tokens) on the in-process engine and on `lichen serve`;
prompts with no room are dropped when the data loads, with a count."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers.runs import dumped_samples

from lichen.config import parse_train_args
from lichen.errors import ConfigError
from lichen.models.tiny import make_tiny_model

POSITIONS = 64
LENGTHS = [10, 30, 50, 62, 63, 70]  # prompt tokens (one per character); 63 and 70 leave no room under 63


@pytest.fixture(scope="module")
def ckpt64(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("tiny64")
    make_tiny_model(str(out), max_position_embeddings=POSITIONS, seed=0, init_std=0.1)
    return str(out)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("ctx_data") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": "1" * n, "label": "1"}) + "\n" for n in LENGTHS))
    return str(path)


def train_argv(ckpt, data, out, *extra) -> list[str]:
    return [
        "--hf-checkpoint",
        ckpt,
        "--prompt-data",
        data,
        "--custom-rm-path",
        "loop_plugins.digit_fraction",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "2",
        "--rollout-max-response-len",
        "200",
        "--num-rollout",
        "1",
        "--debug-rollout-only",
        "--rollout-temperature",
        "1.5",
        "--output-dir",
        str(out),
        "--no-progress",
        "--num-threads",
        "1",
        *extra,
    ]


def cli(*argv) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.path.dirname(__file__)}  # loop_plugins
    return subprocess.run(
        [sys.executable, "-m", "lichen.cli", *argv], capture_output=True, text=True, timeout=300, env=env
    )


def test_defaults_follow_the_model_positions(ckpt64, data, tmp_path):
    args = parse_train_args(train_argv(ckpt64, data, tmp_path))
    assert (args.rollout_max_context_len, args.rollout_max_prompt_len) == (POSITIONS - 1, POSITIONS - 2)
    args = parse_train_args(train_argv(ckpt64, data, tmp_path, "--rollout-max-context-len", "40"))
    assert (args.rollout_max_context_len, args.rollout_max_prompt_len) == (40, 39)
    with pytest.raises(ConfigError, match=r"--rollout-max-context-len 64: the model .* has 64 positions"):
        parse_train_args(train_argv(ckpt64, data, tmp_path, "--rollout-max-context-len", "64"))
    with pytest.raises(ConfigError, match="--rollout-max-prompt-len 40 leaves no room"):
        parse_train_args(
            train_argv(ckpt64, data, tmp_path, "--rollout-max-context-len", "40", "--rollout-max-prompt-len", "40")
        )


def test_too_large_context_is_one_line_exit_2(ckpt64, data, tmp_path):
    r = cli("train", *train_argv(ckpt64, data, tmp_path, "--rollout-max-context-len", "500"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "--rollout-max-context-len 500" in r.stderr


def _samples(path) -> list[dict]:
    return dumped_samples(path)


@pytest.mark.slow
@pytest.mark.parametrize("engines", [[], ["--rollout-num-engines", "1"]], ids=["in-process", "lichen-serve"])
def test_every_sample_fits_and_long_prompts_are_dropped(ckpt64, data, tmp_path, engines):
    dump = tmp_path / "r_{rollout_id}.pt"
    r = cli("train", *train_argv(ckpt64, data, tmp_path / "o", "--save-debug-rollout-data", str(dump), *engines))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "dropped 2 of 6 prompts longer than --rollout-max-prompt-len 62" in r.stderr
    samples = _samples(str(dump).format(rollout_id=0))
    assert len(samples) == 8 and all(s["status"] != "failed" for s in samples), [s["status"] for s in samples]
    for s in samples:
        prompt = len(s["tokens"]) - s["response_length"]
        assert prompt in (10, 30, 50, 62)
        assert len(s["tokens"]) <= POSITIONS - 1 and s["response_length"] <= min(200, POSITIONS - 1 - prompt)
    # the budget is what stopped the samples that did not end themselves: they fill the context exactly
    cut = [s for s in samples if s["status"] == "truncated"]
    assert cut and all(len(s["tokens"]) == POSITIONS - 1 for s in cut)


def test_in_process_engine_refuses_what_does_not_fit(ckpt64):
    from lichen.engines.core.engine import Engine, GenRequest

    engine = Engine.from_pretrained(ckpt64)
    prompt = list(range(20, 30))
    out = engine.generate([GenRequest(prompt, POSITIONS - 1 - len(prompt), temperature=0, ignore_eos=True)])[0]
    assert len(prompt) + len(out.output_ids) == POSITIONS - 1
    with pytest.raises(ValueError, match="exceeds the model's maximum context length of 64 tokens"):
        engine.generate([GenRequest(prompt, POSITIONS - len(prompt))])
    with pytest.raises(ValueError, match=r"The input \(64 tokens\) is longer"):
        engine.generate([GenRequest(list(range(20, 20 + POSITIONS)), 0)])


@pytest.mark.slow
def test_eval_sets_get_the_same_limit(ckpt64, data, tmp_path):
    r = cli(
        "eval",
        "--hf-checkpoint",
        ckpt64,
        "--eval-prompt-data",
        "long",
        data,
        "--rm-type",
        "math",
        "--eval-max-response-len",
        "200",
        "--n-samples-per-eval-prompt",
        "2",
        "--output-dir",
        str(tmp_path),
        "--num-threads",
        "1",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "eval data set 'long': dropped 2 of 6 prompts longer than --rollout-max-prompt-len 62" in r.stderr
