"""`--rollout-sample-hook-path` (slime's flag, issue 30 item 4): hooks run on each sample before its reward, in the
order given, sync or async, with the keyword arguments they accept; a returned Sample takes the sample's place;
anything else is one error naming the flag and the hook. Also its row in the slime table."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lichen.config import build_train_parser, parse_train_args, slime_compat
from lichen.config.parser import option_actions
from lichen.config.rollout_config import RolloutConfig
from lichen.config.slime.flags import SAME
from lichen.errors import ConfigError
from lichen.rollout.context import RolloutContext
from lichen.rollout.samples import score
from lichen.types import Sample

FIXTURES = Path(__file__).parent / "fixtures"
SEEN: list[tuple] = []


def tag_hook(args, sample):  # sync, no keywords: edits in place, returns None
    SEEN.append(("tag", sample.index, sample.reward))  # the reward is not there yet
    sample.metadata["tag"] = args.seed


async def replace_hook(args, sample, *, rollout_id=None, evaluation=False):  # async: returns a new Sample
    SEEN.append(("replace", sample.index, rollout_id, evaluation, sample.metadata.get("tag")))
    return Sample(prompt=sample.prompt, response=sample.response + "!", index=sample.index, metadata=sample.metadata)


def kwargs_hook(args, sample, **kw):
    SEEN.append(("kw", sorted(kw)))


def bad_hook(args, sample):
    return {"reward": 1}


def reward(args, sample):
    SEEN.append(("reward", sample.index, sample.response))
    return 1.0 if sample.response.endswith("!") else 0.0


@pytest.fixture
def base(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text((FIXTURES / "slime" / "hf" / "Qwen3-4B" / "config.json").read_text())
    for f in (FIXTURES / "slime" / "tokenizer").iterdir():
        shutil.copy(f, hf / f.name)
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    SEEN.clear()
    data = ["--prompt-data", str(tmp_path / "p.jsonl"), "--rollout-batch-size", "1", "--num-rollout", "1"]
    return ["--hf-checkpoint", str(hf), *data, "--n-samples-per-prompt", "2", "--rm-type", "math"]


def _hooks(*names: str) -> list[str]:
    return [t for n in names for t in ("--rollout-sample-hook-path", f"test_sample_hooks.{n}")]


@pytest.mark.parametrize("evaluation", [False, True])
def test_hooks_run_in_order_before_the_reward(base, evaluation):
    args = parse_train_args(base + _hooks("tag_hook", "replace_hook", "kwargs_hook") + ["--seed", "7"])
    ctx = RolloutContext(args=args, config=RolloutConfig.from_args(args), engine=None, tokenizer=None)
    ctx.rollout_id = 3
    group = [Sample(prompt="p", response="a", index=0), Sample(prompt="p", response="b", index=1)]
    kept = list(group)
    score(ctx, group, reward, evaluation=evaluation)
    assert SEEN == [
        ("tag", 0, None),
        ("replace", 0, 3, evaluation, 7),
        ("kw", ["evaluation", "rollout_id"]),
        ("tag", 1, None),
        ("replace", 1, 3, evaluation, 7),
        ("kw", ["evaluation", "rollout_id"]),
        ("reward", 0, "a!"),
        ("reward", 1, "b!"),
    ]
    # the replacement took the sample's place in the group (same objects, the hook's contents) and was scored
    assert [s is k for s, k in zip(group, kept)] == [True, True]
    assert [(s.response, s.reward, s.metadata["tag"]) for s in group] == [("a!", 1.0, 7), ("b!", 1.0, 7)]


def test_without_hooks_nothing_runs(base):
    args = parse_train_args(base)
    ctx = RolloutContext(args=args, config=RolloutConfig.from_args(args), engine=None, tokenizer=None)
    sample = Sample(prompt="p", response="a")
    score(ctx, [sample], reward)
    assert SEEN == [("reward", 0, "a")] and sample.reward == 0.0


def test_a_hook_returning_something_else_is_one_error_naming_it(base):
    args = parse_train_args(base + _hooks("bad_hook"))
    ctx = RolloutContext(args=args, config=RolloutConfig.from_args(args), engine=None, tokenizer=None)
    with pytest.raises(
        ConfigError,
        match=r"--rollout-sample-hook-path 'test_sample_hooks.bad_hook': the hook "
        r"returned dict; it must return a Sample or None",
    ):
        score(ctx, [Sample(prompt="p", response="a")], reward)


def test_a_hook_that_does_not_load_stops_the_config(base):
    with pytest.raises(ConfigError, match=r"--rollout-sample-hook-path 'test_sample_hooks.nothing'.*no attribute"):
        parse_train_args(base + _hooks("nothing"))


def test_slime_row_is_same():
    known = {s for s in option_actions(build_train_parser()) if s.startswith("--")}
    (row,) = slime_compat.scan(["--rollout-sample-hook-path", "my.hook"], known).rows
    assert row.cls == SAME
