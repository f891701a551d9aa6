"""The rollout function contract (lichen.rollout.base_types), as slime has it:

    fn(args, rollout_id, data_source, evaluation=False) -> RolloutFnTrainOutput | RolloutFnEvalOutput

with lichen's engine, tokenizer and rewards reached through lichen.rollout.context.current(); a plain list of
groups is accepted; the old lichen signature fn(args, rollout_id, prompts, manager) still runs, with a
DeprecationWarning. The rollout worker is long-lived: state_dict() / load_state_dict() / close().
"""

from __future__ import annotations

import asyncio
import time
import warnings

import pytest
from helpers.rollout import rollout_worker
from helpers.runs import base_args

from lichen.config import parse_train_args
from lichen.errors import ConfigError
from lichen.rewards import score_samples
from lichen.rollout import context
from lichen.rollout.base_types import RolloutFn, RolloutFnEvalOutput, RolloutFnTrainOutput
from lichen.rollout.generate import generate_rollout
from lichen.types import Sample, Status

SEEN: dict = {}


# ---- plug-ins (by dotted path) -----------------------------------------------------------------------------------
def _answer(groups: list[list[Sample]], text: str = "7") -> None:
    """Fill every pending sample of `groups` with the response `text` + EOS, scored by the training reward."""
    ctx = context.current()
    resp = ctx.tokenizer.encode(text, add_special_tokens=False) + [ctx.tokenizer.eos_token_id]
    for group in groups:
        for s in group:
            s.tokens, s.response, s.response_length = s.tokens + resp, text, len(resp)
            s.loss_mask, s.status = [1] * len(resp), Status.COMPLETED
            s.weight_versions = [ctx.engine.weight_version]
    score_samples([s for g in groups for s in g], ctx.reward_fn, SEEN["args"])


def slime_style(args, rollout_id, data_source, evaluation=False):
    SEEN.update(args=args, rollout_id=rollout_id, data_source=data_source, evaluation=evaluation)
    groups = data_source.get_samples(args.rollout_batch_size)
    _answer(groups)
    return RolloutFnTrainOutput(samples=groups, metrics={"custom/answered": len(groups)})


def plain_list(args, rollout_id, data_source, evaluation=False):
    SEEN["args"] = args
    groups = data_source.get_samples(args.rollout_batch_size)
    _answer(groups)
    return groups


def old_signature(args, rollout_id, prompts, manager):
    """lichen's former contract: the manager's batch of (data index, record) and the manager itself."""
    SEEN.update(args=args, prompts=[i for i, _ in prompts])
    return generate_rollout(args, rollout_id, prompts, manager)


def wraps_default(args, rollout_id, data_source, evaluation=False):
    SEEN["calls"] = SEEN.get("calls", 0) + 1
    return generate_rollout(args, rollout_id, data_source, evaluation=evaluation)


def evaluates(args, rollout_id, data_source, evaluation=False):
    """An eval function: one data set of its own, its samples returned flat (grouped by group_index)."""
    SEEN.update(args=args, rollout_id=rollout_id, evaluation=evaluation)
    ctx = context.current()
    name, (cfg, records) = next(iter(ctx.eval_sets.items()))
    groups = [
        [
            Sample(
                prompt=r.prompt, tokens=ctx.encode(i, r, dataset=name), label=r.label, group_index=i, index=i * 2 + j
            )
            for j in range(2)
        ]
        for i, r in enumerate(records[:3])
    ]
    _answer(groups, text=str(groups[0][0].label))  # every sample answers the first prompt's label
    return RolloutFnEvalOutput(data={name: {"samples": [s for g in groups for s in g]}}, metrics={"custom/x": 1.0})


def returns_none(args, rollout_id, data_source, evaluation=False):
    return None


IN_FLIGHT = {"now": 0, "max": 0}


async def slow_or_hanging_reward(args, sample) -> float:
    """Counts the calls in flight; sample 0's call never ends."""
    IN_FLIGHT["now"] += 1
    IN_FLIGHT["max"] = max(IN_FLIGHT["max"], IN_FLIGHT["now"])
    try:
        await asyncio.sleep(600 if sample.index == 0 else 0.05)
    finally:
        IN_FLIGHT["now"] -= 1
    return 1.0


def record_reward(args, sample) -> float:
    SEEN.setdefault("reward_args", []).append(args)
    return float(sample.response.strip().startswith(str(sample.label)))


# ---- helpers -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    from lichen.engines.core.engine import Engine

    return Engine.from_pretrained(tiny_ckpt, device="cpu")


@pytest.fixture
def worker(tiny_ckpt, addition_data, tmp_path, engine):
    made = []

    def make(*extra):
        SEEN.clear()
        argv = base_args(
            tiny_ckpt, addition_data, tmp_path / "o", "--num-rollout", "3", "--n-samples-per-prompt", "2", *extra
        )
        args = parse_train_args(argv[1:])
        made.append(rollout_worker(args, engine=engine))
        return made[-1]

    yield make
    for w in made:
        w.close()


def _dicts(groups):
    return [[s.to_dict() for s in g] for g in groups]


# ---- tests -------------------------------------------------------------------------------------------------------
def test_slime_style_function_gets_args_step_and_data_source(worker):
    w = worker("--rollout-function-path", "test_rollout_contract.slime_style")
    groups, metrics = w.generate(5)
    assert SEEN["rollout_id"] == 5 and SEEN["evaluation"] is False and SEEN["data_source"] is w.data_source
    assert [len(g) for g in groups] == [2, 2, 2, 2] and [s.index for g in groups for s in g] == list(range(8))
    assert [g[0].metadata["prompt_index"] for g in groups] == [0, 1, 2, 3]
    assert metrics["custom/answered"] == 4 and metrics["rollout/num_samples"] == 8  # its metrics join lichen's
    assert w.data_source.source.offset == 4


def test_a_plain_list_of_groups_is_accepted(worker):
    w = worker("--rollout-function-path", "test_rollout_contract.plain_list")
    groups, metrics = w.generate(0)
    assert len(groups) == 4 and metrics["rollout/num_samples"] == 8


def test_old_signature_still_works_with_a_deprecation_warning(worker):
    with pytest.warns(DeprecationWarning, match="fn\\(args, rollout_id, prompts, manager\\) is deprecated"):
        w = worker("--rollout-function-path", "test_rollout_contract.old_signature")
    with pytest.warns(DeprecationWarning, match="generate_rollout\\(args, rollout_id, prompts, manager\\)"):
        groups, metrics = w.generate(0)
    assert SEEN["prompts"] == [0, 1, 2, 3]
    default = worker()
    expected, expected_metrics = default.generate(0)
    assert _dicts(groups) == _dicts(expected)
    assert metrics.keys() == expected_metrics.keys()  # time/reward and the rest, as before


def test_the_current_contract_warns_nothing_and_wrapping_the_default_changes_nothing(worker):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        w = worker("--rollout-function-path", "test_rollout_contract.wraps_default")
        groups, _ = w.generate(0)
    assert SEEN["calls"] == 1
    assert _dicts(groups) == _dicts(worker().generate(0)[0])


def test_wrong_return_is_a_user_error(worker):
    w = worker("--rollout-function-path", "test_rollout_contract.returns_none")
    with pytest.raises(ConfigError, match="--rollout-function-path: returned a NoneType; return RolloutFnTrainOutput"):
        w.generate(0)


def test_plugins_receive_the_full_resolved_args(worker, addition_data):
    w = worker(
        "--rollout-function-path",
        "test_rollout_contract.slime_style",
        "--custom-rm-path",
        "test_rollout_contract.record_reward",
        "--eval-prompt-data",
        "add",
        addition_data,
    )
    w.generate(0)
    args = SEEN["args"]
    assert args is w.args  # the namespace itself, not a copy or a config object
    assert all(a is args for a in SEEN["reward_args"]) and len(SEEN["reward_args"]) == 8
    # resolved: values validation derives are there, not only the flags given
    assert args.rollout_max_context_len is not None and args.eval_dataset_configs[0]["name"] == "add"
    assert args.custom_rm_path == "test_rollout_contract.record_reward" and args.num_rollout == 3


def test_eval_runs_through_the_same_contract(worker, addition_data):
    w = worker(
        "--eval-prompt-data",
        "add",
        addition_data,
        "--eval-function-path",
        "test_rollout_contract.evaluates",
        "--custom-rm-path",
        "test_rollout_contract.record_reward",
        "--n-samples-per-eval-prompt",
        "2",
    )
    metrics = w.eval(version=2)
    assert SEEN["evaluation"] is True and SEEN["rollout_id"] == 2 and SEEN["args"] is w.args
    # flat samples are grouped by prompt: 3 prompts x 2; only prompt 0's label was answered
    assert metrics["eval/add/num_prompts"] == 3 and metrics["eval/add/num_samples"] == 6
    assert metrics["eval/add/pass@2"] == pytest.approx(1 / 3) and metrics["custom/x"] == 1.0
    assert "time/eval" in metrics

    default = worker("--eval-prompt-data", "add", addition_data, "--n-samples-per-eval-prompt", "2")
    out = RolloutFn(generate_rollout)
    with context.active(default.context):
        result = out.call(default.args, 0, default.data_source, evaluation=True)
    assert isinstance(result, RolloutFnEvalOutput) and set(result.data) == {"add"}
    groups = result.data["add"]["samples"]
    assert all(len(g) == 2 for g in groups) and len(result.data["add"]["rewards"]) == 2 * len(groups)
    lichen_eval = default.eval(version=0)
    assert lichen_eval["eval/add/num_samples"] == 2 * len(groups)


def test_an_old_signature_function_cannot_evaluate(worker, addition_data):
    with pytest.warns(DeprecationWarning):
        w = worker(
            "--eval-prompt-data", "add", addition_data, "--eval-function-path", "test_rollout_contract.old_signature"
        )
    with pytest.raises(ConfigError, match="--eval-function-path: a function with the old signature"):
        w.eval(version=0)


def test_current_outside_a_rollout_function_is_an_error():
    with pytest.raises(RuntimeError, match="only available inside a rollout or eval function"):
        context.current()


def test_worker_state_round_trip_resumes_exactly(worker):
    a = worker()
    a.generate(0)
    state = a.state_dict()
    assert set(state) == {"source", "partial_rollout"}  # the checkpoint's rollout state, as before
    expected, _ = a.generate(1)
    b = worker()
    b.load_state_dict(state)
    got, _ = b.generate(1)
    assert _dicts(got) == _dicts(expected)
    assert b.state_dict() == a.state_dict()


def test_data_source_get_and_add_samples_round_trip(worker):
    w = worker()
    ds = w.data_source
    first = ds.get_samples(3)
    assert [[s.status for s in g] for g in first] == [[Status.PENDING] * 2] * 3
    assert first[1][0].tokens == w.context.encode(1, ds.source.records[1]) and first[2][1].index == 5
    ds.add_samples(first[1:])  # handed back: returned first, before new prompts
    state = ds.state_dict()
    again = ds.get_samples(3)
    assert [g[0].metadata["prompt_index"] for g in again] == [1, 2, 3] and len(ds.buffer) == 0
    other = worker().data_source
    other.load_state_dict(state)
    assert _dicts(other.get_samples(3)) == _dicts(again)


def test_the_rollout_scores_with_the_reward_flags(worker):
    w = worker(
        "--custom-rm-path",
        "test_rollout_contract.slow_or_hanging_reward",
        "--reward-concurrency",
        "2",
        "--reward-timeout",
        "0.5",
    )
    IN_FLIGHT.update(now=0, max=0)
    t0 = time.perf_counter()
    groups, metrics = w.generate(0)
    assert time.perf_counter() - t0 < 300  # the hanging call was cut (it sleeps 600 s)
    first = groups[0][0]
    assert first.status is Status.FAILED and "timeout after 0.5 s" in first.metadata["reward_error"]
    assert metrics["rollout/num_failed"] == 1 and IN_FLIGHT["max"] == 2
