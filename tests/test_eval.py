"""Evaluation: the unbiased pass@k estimator against brute force, per-data-set metrics, and `--eval-config`
resolution (entry > defaults > flags) and its errors."""

from __future__ import annotations

import itertools
import random
import textwrap

import pytest

from lichen.config import parse_train_args
from lichen.errors import ConfigError
from lichen.rollout.eval import eval_metrics, pass_at_k, pass_k_values, tool_use_metrics
from lichen.rollout.manager import rollout_metrics
from lichen.types import Sample, Status

# ---------------------------------------------------------------------------------------------- pass@k


def brute_force_pass_at_k(outcomes: list[bool], k: int) -> float:
    """Share of all k-subsets of the samples that hold at least one correct sample."""
    subsets = list(itertools.combinations(range(len(outcomes)), k))
    return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_matches_brute_force(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(outcomes, k), abs=1e-12)


def test_pass_at_k_hand_values():
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 3, 3) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_pass_k_values():
    assert pass_k_values(1) == [1]
    assert pass_k_values(4) == [1, 2, 4]
    assert pass_k_values(6) == [1, 2, 4]  # powers of two only, as slime (no k = n = 6)
    assert pass_k_values(8) == [1, 2, 4, 8]
    assert pass_k_values(0) == []


def make(reward, status=Status.COMPLETED, length=3) -> Sample:
    return Sample(reward=reward, status=status, response_length=length)


def test_eval_metrics_hand_checked():
    groups = [
        [make(1.0), make(0.0), make(0.0, Status.TRUNCATED, 8), make(1.0)],  # c = 2
        [make(0.0), make(5.0, Status.FAILED), make(0.0), make(0.0)],  # the failed one does not count: c = 0
    ]
    m = eval_metrics(groups, None)
    assert m["reward_mean"] == pytest.approx(2.0 / 7)  # 7 scored samples
    assert m["truncated_ratio"] == 1 / 8
    assert m["response_length_mean"] == pytest.approx((7 * 3 + 8) / 8)
    assert (m["num_failed"], m["num_samples"], m["num_prompts"]) == (1, 8, 2)
    assert m["pass@1"] == pytest.approx((2 / 4 + 0) / 2)
    assert m["pass@2"] == pytest.approx((1 - 1 / 6 + 0) / 2)  # 1 - C(2,2)/C(4,2)
    assert m["pass@4"] == pytest.approx(0.5)
    assert "pass@3" not in m and "pass@8" not in m


def test_tool_use_metrics_hand_checked():
    def traj(calls: int, turns: int, fidelity=None, checked: bool = True) -> Sample:
        s = make(1.0)
        s.metadata = {"tool_calls": [{"name": "calc"}] * calls, "turns": turns}
        if checked:
            s.metadata["token_fidelity"] = fidelity
        return s

    plain = make(1.0)  # not a tool trajectory (e.g. another data set's sample): not counted
    samples = [traj(0, 1), traj(2, 3, {"position": 7}), traj(1, 2), traj(1, 2, checked=False), plain]
    m = tool_use_metrics(samples)
    assert m == {
        "tool_call_ratio": 3 / 4,
        "tool_calls_mean": 1.0,
        "turns_mean": 2.0,
        "token_fidelity_mismatch_ratio": 1 / 3,
    }
    assert tool_use_metrics([plain, make(0.0)]) == {}  # no tool rollout: no tool metric
    assert tool_use_metrics([traj(1, 2, checked=False)]) == {
        "tool_call_ratio": 1.0,
        "tool_calls_mean": 1.0,
        "turns_mean": 2.0,
    }
    assert eval_metrics([samples[:2], samples[2:4]], None)["tool_call_ratio"] == 3 / 4
    assert rollout_metrics([samples], None)["rollout/tool_calls_mean"] == 1.0
    assert "rollout/tool_call_ratio" not in rollout_metrics([[plain]], None)


def test_eval_metrics_against_brute_force_random():
    rng = random.Random(0)
    n = 6
    groups = [[make(rng.choice([-1.0, 0.0, 1.0, 0.5])) for _ in range(n)] for _ in range(20)]
    m = eval_metrics(groups, None)
    for k in pass_k_values(n):
        want = sum(brute_force_pass_at_k([s.reward == 1 for s in g], k) for g in groups) / len(groups)  # slime
        assert m[f"pass@{k}"] == pytest.approx(want)


def test_eval_metrics_dict_rewards_use_the_key():
    groups = [[Sample(reward={"score": -1.0, "acc": False}), Sample(reward={"score": 1.0, "acc": True})]]
    m = eval_metrics(groups, "score")
    assert m["reward_mean"] == 0.0 and m["pass@1"] == 0.5 and m["pass@2"] == 1.0


# ----------------------------------------------------------------------------------------- --eval-config


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    for name in ("prompts.jsonl", "a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text('{"prompt": "1+1=", "label": "2"}\n')
    return tmp_path


BASE = [
    "--hf-checkpoint",
    "hf",
    "--rollout-batch-size",
    "1",
    "--n-samples-per-prompt",
    "2",
    "--prompt-data",
    "prompts.jsonl",
]


def parse(*extra: str):
    return parse_train_args([*BASE, "--rm-type", "math", "--num-rollout", "1", *extra])


def write(path, text: str) -> str:
    path.write_text(textwrap.dedent(text))
    return str(path.name)


def test_resolution_entry_over_defaults_over_flags(files):
    cfg = write(
        files / "eval.yaml",
        """\
        defaults:
          n_samples_per_eval_prompt: 4
          temperature: 0.6
          rm_type: dapo
        datasets:
          - name: aime
            path: a.jsonl@[:1]
            temperature: 0.0
            max_response_len: 99
          - name: qa
            path: b.jsonl
            rm_type: f1
            input_key: question
            top_k: 5
          - name: mine
            path: b.jsonl
            custom_rm_path: os.path.join
        """,
    )
    args = parse(
        "--eval-config",
        cfg,
        "--eval-prompt-data",
        "flagged",
        "a.jsonl",
        "--eval-top-p",
        "0.9",
        "--eval-max-response-len",
        "32",
        "--eval-reward-key",
        "score",
        "--eval-interval",
        "2",
    )
    assert args.eval_datasets == [
        ("flagged", "a.jsonl"),
        ("aime", "a.jsonl@[:1]"),
        ("qa", "b.jsonl"),
        ("mine", "b.jsonl"),
    ]
    flagged, aime, qa, mine = args.eval_dataset_configs
    # no entry of its own: the file's defaults, then the flags
    assert (flagged["n_samples_per_eval_prompt"], flagged["temperature"], flagged["rm_type"]) == (4, 0.6, "dapo")
    assert (flagged["top_p"], flagged["max_response_len"], flagged["reward_key"]) == (0.9, 32, "score")
    assert (flagged["top_k"], flagged["input_key"], flagged["apply_chat_template"]) == (-1, "prompt", False)
    # entry > defaults > flags
    assert (aime["n_samples_per_eval_prompt"], aime["temperature"], aime["max_response_len"]) == (4, 0.0, 99)
    assert (aime["rm_type"], aime["top_p"], aime["top_k"], aime["input_key"]) == ("dapo", 0.9, -1, "prompt")
    assert (qa["rm_type"], qa["temperature"], qa["top_k"], qa["input_key"]) == ("f1", 0.6, 5, "question")
    # a custom reward in an entry replaces the inherited rm_type as one unit
    assert (mine["rm_type"], mine["custom_rm_path"]) == (None, "os.path.join")


def test_flag_custom_rm_reaches_eval(files):
    args = parse_train_args(
        [*BASE, "--custom-rm-path", "os.path.join", "--num-rollout", "1", "--eval-prompt-data", "x", "a.jsonl"]
    )
    (cfg,) = args.eval_dataset_configs
    assert (cfg["rm_type"], cfg["custom_rm_path"]) == (None, "os.path.join")


@pytest.mark.parametrize(
    "text,expect",
    [
        (
            "datasets:\n  - name: a\n    path: a.jsonl\n    temprature: 0.5\n",
            ["eval.yaml:4", "unknown key 'temprature'", "did you mean 'temperature'"],
        ),
        ("datasets:\n  - {name: a, path: a.jsonl}\nsettings: {}\n", ["eval.yaml:3", "unknown key 'settings'"]),
        (
            "defaults:\n  name: x\ndatasets:\n  - {name: a, path: a.jsonl}\n",
            ["eval.yaml:2", "unknown key 'name' in defaults", "only a data set entry"],
        ),
        ("datasets:\n  - name: a\n", ["eval.yaml:2", "datasets[0] has no `path:`"]),
        ("datasets: []\n", ["`datasets:` must be a non-empty list"]),
        ("- a\n", ["must be a mapping"]),
        ("datasets:\n  - {name: a, path: a.jsonl, top_p: 0}\n", ["datasets[0].top_p = 0", "(0, 1]"]),
        ("datasets:\n  - {name: a, path: a.jsonl, n_samples_per_eval_prompt: 2.5}\n", ["an integer >= 1"]),
        ("datasets:\n  - {name: a, path: a.jsonl, rm_type: mathh}\n", ["rm_type 'mathh' is not a known rm type"]),
        (
            "datasets:\n  - {name: a, path: a.jsonl, rm_type: math, custom_rm_path: os.path.join}\n",
            ["exclude each other"],
        ),
        ("datasets:\n  - {name: a, path: missing.jsonl}\n", ["datasets[0] (a)", "'missing.jsonl' does not exist"]),
        ("datasets:\n  - {name: flagged, path: a.jsonl}\n", ["'flagged' is used twice"]),
        ("datasets: [\n", ["not valid YAML"]),
    ],
)
def test_eval_config_errors(files, text, expect):
    cfg = write(files / "eval.yaml", text)
    with pytest.raises(ConfigError) as e:
        parse("--eval-config", cfg, "--eval-prompt-data", "flagged", "a.jsonl")
    msg = str(e.value)
    assert "--eval-config" in msg or "flagged" in msg
    for part in expect:
        assert part in msg, msg


def test_eval_config_missing_file_and_interval(files):
    with pytest.raises(ConfigError, match="--eval-config 'nope.yaml': no such file"):
        parse("--eval-config", "nope.yaml")
    cfg = write(files / "eval.yaml", "datasets:\n  - {name: a, path: a.jsonl}\n")
    assert parse("--eval-config", cfg, "--eval-interval", "1").eval_interval == 1  # the file alone is enough
    with pytest.raises(ConfigError, match="--eval-interval needs"):
        parse("--eval-interval", "1")


def test_reward_flags_checked(files):
    with pytest.raises(ConfigError, match="--rm-url"):
        parse_train_args([*BASE, "--rm-type", "remote_rm", "--num-rollout", "1"])
    with pytest.raises(ConfigError, match="--group-rm"):
        parse("--group-rm")
    with pytest.raises(ConfigError, match="--rm-type 'bogus'"):
        parse_train_args([*BASE, "--rm-type", "bogus", "--num-rollout", "1"])
    with pytest.raises(ConfigError, match="--eval-rm-type 'nope'"):
        parse("--eval-rm-type", "nope")
    with pytest.raises(ConfigError, match="--reward-timeout"):
        parse("--reward-timeout", "0")
    args = parse("--reward-concurrency", "3", "--code-timeout", "2.5")
    assert (args.reward_concurrency, args.code_timeout, args.reward_timeout) == (3, 2.5, 60.0)
