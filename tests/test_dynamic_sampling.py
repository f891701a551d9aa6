"""DAPO dynamic sampling (group filter, over-sampling rounds) and the soft overlong penalty (Algorithms, item 6)."""

import glob
import logging
import math

import ds_plugins
import numpy as np
import pytest
from helpers.runs import read_dump

from lichen.cli import main
from lichen.config import parse_train_args, sampling
from lichen.engines.core.sampler import derive_seed
from lichen.errors import ConfigError, UserError
from lichen.rollout.filters import (
    check_reward_nonzero_std,
    min_trainable_groups,
    run_group_filter,
    trainable_group_count,
)
from lichen.rollout.generate import SEED_ROUND_STRIDE
from lichen.rollout.shaping import add_to_reward, apply_overlong_penalty, overlong_metrics, overlong_penalty
from lichen.types import Sample, Status

BUILTIN = "lichen.rollout.filters.check_reward_nonzero_std"


# ---------------------------------------------------------------- overlong penalty (pure)


@pytest.mark.parametrize(
    "length, L, B, F, expected",
    [
        (0, 20, 5, 1.0, 0.0),
        (15, 20, 5, 1.0, 0.0),  # exactly L - B: no penalty
        (16, 20, 5, 1.0, -0.2),
        (18, 20, 5, 1.0, -0.6),
        (20, 20, 5, 1.0, -1.0),  # full length: -F
        (23, 20, 5, 1.0, -1.0),  # capped at -F
        (17, 20, 5, 0.5, -0.2),  # -(2/5) * 0.5
        (0, 8, 8, 1.0, 0.0),  # B = L: every token counts
        (2, 8, 8, 2.0, -0.5),  # -(2/8) * 2
        (8, 8, 1, 3.0, -3.0),
        (7, 8, 1, 3.0, 0.0),
    ],
)
def test_overlong_penalty_hand_values(length, L, B, F, expected):
    assert overlong_penalty(length, L, B, F) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("B", [0, -1, 21])
def test_overlong_penalty_rejects_buffer_outside_0_L(B):
    with pytest.raises(ValueError):
        overlong_penalty(10, 20, B, 1.0)


def test_add_to_reward_float_dict_and_missing_key():
    s = Sample(reward=0.25)
    add_to_reward(s, -0.5, None)
    assert s.reward == -0.25
    s = Sample(reward={"score": 1.0, "acc": 2})
    add_to_reward(s, -0.5, None)
    assert s.reward == {"score": 0.5, "acc": 2}
    add_to_reward(s, -1.0, "acc")
    assert s.reward == {"score": 0.5, "acc": 1.0}
    with pytest.raises(ConfigError, match="--reward-key"):
        add_to_reward(Sample(reward={"acc": 1.0}), -0.5, None)


def test_apply_overlong_penalty_leaves_failed_samples_alone():
    samples = [
        Sample(reward=1.0, response_length=10, status=Status.TRUNCATED),
        Sample(reward=0.0, response_length=10, status=Status.FAILED, metadata={"reward_error": "x"}),
        Sample(reward=1.0, response_length=6, status=Status.COMPLETED),
    ]
    apply_overlong_penalty(samples, max_response_len=10, buffer_len=4, factor=1.0, reward_key=None)
    assert samples[0].reward == 0.0 and samples[0].metadata["overlong_penalty"] == -1.0
    assert samples[1].reward == 0.0 and "overlong_penalty" not in samples[1].metadata
    assert samples[2].reward == 1.0 and samples[2].metadata["overlong_penalty"] == 0.0
    assert overlong_metrics(samples) == {"rollout/overlong_penalty_mean": -0.5, "rollout/overlong_penalized_ratio": 0.5}
    assert overlong_metrics([Sample(reward=1.0)]) == {}


# ---------------------------------------------------------------- filters and bookkeeping (pure)


def _group(rewards, failed=()):
    return [Sample(reward=r, status=Status.FAILED if j in failed else Status.COMPLETED) for j, r in enumerate(rewards)]


class _Args:
    reward_key = None


def test_check_reward_nonzero_std():
    assert check_reward_nonzero_std(_Args, _group([1.0, 0.0, 1.0]))
    assert not check_reward_nonzero_std(_Args, _group([1.0, 1.0, 1.0]))
    assert not check_reward_nonzero_std(_Args, _group([0.0, 0.0]))
    # the failed sample's 0.0 is not a reward: the valid ones are all equal
    assert not check_reward_nonzero_std(_Args, _group([1.0, 0.0, 1.0], failed={1}))
    assert not check_reward_nonzero_std(_Args, _group([1.0, 0.0], failed={1}))  # one valid sample: no std
    keyed = type("A", (), {"reward_key": "acc"})
    assert check_reward_nonzero_std(keyed, _group([{"score": 1, "acc": 0}, {"score": 1, "acc": 1}]))
    assert not check_reward_nonzero_std(_Args, _group([{"score": 1, "acc": 0}, {"score": 1, "acc": 1}]))


def test_trainable_group_count_matches_brute_force():
    for steps in range(1, 7):
        for n in range(1, 6):
            unit = min(k for k in range(1, 100) if k * n % steps == 0)
            assert min_trainable_groups(n, steps) == unit
            for k in range(0, 13):
                expected = max(kk for kk in range(0, k + 1) if kk * n % steps == 0)
                assert trainable_group_count(k, n, steps) == expected, (k, n, steps)


def test_run_group_filter_contract():
    groups = [_group([1.0, 0.0]), _group([1.0, 1.0])]
    assert run_group_filter(check_reward_nonzero_std, _Args, groups) == [True, False]
    assert run_group_filter(ds_plugins.keep_numpy_bool, _Args, groups) == [True, True]
    with pytest.raises(UserError, match="--dynamic-sampling-filter-path.*returned NoneType"):
        run_group_filter(ds_plugins.returns_none, _Args, groups, "ds_plugins.returns_none")


# ---------------------------------------------------------------- rollout with the tiny model


def _argv(ckpt, data, *extra, reward="loop_plugins.digit_fraction", n=2):
    single = ["--disable-rewards-normalization"] if n == 1 else []  # GRPO rejects groups of one otherwise
    return [
        "--hf-checkpoint",
        ckpt,
        "--prompt-data",
        data,
        "--custom-rm-path",
        reward,
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        str(n),
        "--rollout-max-response-len",
        "6",
        "--num-rollout",
        "2",
        *single,
        *extra,
    ]


def _parse(argv):
    """parse_train_args, then the sampling group's checks (a no-op repeat once validate.py runs them itself)."""
    args = parse_train_args(argv)
    sampling.check(args)
    return args


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    from lichen.engines.core.engine import Engine

    return Engine.from_pretrained(tiny_ckpt, device="cpu")


@pytest.fixture
def make_manager(tiny_ckpt, addition_data, engine):
    from helpers.rollout import rollout_worker

    def make(*extra, **kw):
        args = _parse(_argv(tiny_ckpt, addition_data, *extra, **kw))
        return rollout_worker(args, engine=engine)

    return make


@pytest.fixture
def lichen_log():
    """Records lichen's log lines (its logger does not propagate, so caplog cannot see them)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("lichen")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def _record_seeds(manager):
    """Wrap the engine so each generate call's request seeds are recorded (one list per call)."""
    calls, orig = [], manager.engine.generate

    def generate(requests):
        calls.append([r.seed for r in requests])
        return orig(requests)

    manager.context.engine = type(
        "Wrapped", (), {"generate": staticmethod(generate), "weight_version": manager.engine.weight_version}
    )()
    return calls


def test_keeps_only_groups_with_reward_spread_renumbers_and_reseeds(make_manager):
    m = make_manager(
        "--dynamic-sampling-filter-path",
        BUILTIN,
        "--over-sampling-batch-size",
        "8",
        reward="ds_plugins.varies_every_fourth",
    )
    calls = _record_seeds(m)
    groups, extra = m.generate(3)
    # rounds of 8 prompts (no shuffle: data indices 0..7, then 8..15); only multiples of 4 have reward spread
    assert [g[0].metadata["prompt_index"] for g in groups] == [0, 4, 8, 12]
    assert [g[0].metadata["dynamic_sampling_round"] for g in groups] == [0, 0, 1, 1]
    for gi, group in enumerate(groups):
        assert [s.group_index for s in group] == [gi, gi]
        assert [s.index for s in group] == [2 * gi, 2 * gi + 1]
        assert [s.reward for s in group] == [0.0, 1.0]
        assert len({s.metadata["prompt_index"] for s in group}) == 1
    # round r samples with seed key rollout_id * stride + r: the reference is derive_seed itself
    assert len(calls) == 2
    for r, seeds in enumerate(calls):
        key = 3 * SEED_ROUND_STRIDE + r
        assert seeds == [derive_seed(m.args.seed, key, pos, j) for pos in range(8) for j in range(2)]
    assert not set(calls[0]) & set(calls[1])
    assert extra["rollout/dynamic_sampling_rounds"] == 2
    assert extra["rollout/dynamic_sampling_generated_groups"] == 16
    assert extra["rollout/dynamic_sampling_dropped_groups"] == 12
    assert extra["rollout/dynamic_sampling_kept_groups"] == 4
    assert extra["rollout/dynamic_sampling_pass_rate"] == 0.25
    # every prompt taken from the source was generated: the saved position is exactly 16 prompts on
    assert (m.data_source.source.epoch, m.data_source.source.offset) == (0, 16)
    assert m.data_source.source.batch_size == 4


def test_surplus_passing_groups_are_discarded_and_position_stays_exact(make_manager, lichen_log):
    m = make_manager("--dynamic-sampling-filter-path", "ds_plugins.contract_probe", "--over-sampling-batch-size", "6")
    ds_plugins.CALLS.clear()
    groups, extra = m.generate(0)
    assert [g[0].metadata["prompt_index"] for g in groups] == [0, 1, 2, 3]
    assert extra["rollout/dynamic_sampling_discarded_groups"] == 2
    assert m.data_source.source.offset == 6
    assert extra["rollout/num_samples"] == 8
    assert any("beyond --rollout-batch-size 4" in r.getMessage() for r in lichen_log)
    # the filter contract: (args, one prompt's group of n scored samples)
    assert len(ds_plugins.CALLS) == 6
    for pos, (args, group) in enumerate(ds_plugins.CALLS):
        assert args is m.args
        assert isinstance(group, list) and len(group) == 2
        assert all(isinstance(s, Sample) and isinstance(s.reward, float) for s in group)
        assert {s.metadata["prompt_index"] for s in group} == {pos}


def test_resume_from_saved_source_position_reproduces_next_step(make_manager):
    flags = ("--dynamic-sampling-filter-path", BUILTIN, "--over-sampling-batch-size", "6")
    a = make_manager(*flags)
    a.generate(0)
    state = a.state_dict()
    expected, _ = a.generate(1)
    b = make_manager(*flags)
    b.load_state_dict(state)
    got, _ = b.generate(1)
    assert [[(s.tokens, s.reward, s.group_index, s.index) for s in g] for g in got] == [
        [(s.tokens, s.reward, s.group_index, s.index) for s in g] for g in expected
    ]
    assert b.data_source.source.state_dict() == a.data_source.source.state_dict()


@pytest.mark.parametrize("n, steps, fillers", [(2, 1, 1), (1, 4, 4)])
def test_max_rounds_reached_with_nothing_kept(make_manager, lichen_log, n, steps, fillers):
    m = make_manager(
        "--dynamic-sampling-filter-path",
        "ds_plugins.reject_all",
        "--dynamic-sampling-max-rounds",
        "3",
        "--num-steps-per-rollout",
        str(steps),
        n=n,
    )
    groups, extra = m.generate(0)
    assert extra["rollout/dynamic_sampling_rounds"] == 3
    assert extra["rollout/dynamic_sampling_passed_groups"] == 0
    assert m.data_source.source.offset == 12  # 3 rounds of 4 prompts
    # nothing passed: the smallest batch the trainer can split, filled from rejected groups and marked so
    assert len(groups) == fillers == extra["rollout/dynamic_sampling_filler_groups"]
    assert len(groups) * n % steps == 0
    assert all(s.metadata["dynamic_sampling_filler"] for g in groups for s in g)
    assert [s.group_index for g in groups for s in g] == [gi for gi in range(fillers) for _ in range(n)]
    warnings = [r.getMessage() for r in lichen_log if r.levelno == logging.WARNING]
    assert any("only 0 of 4 groups passed" in w and "--dynamic-sampling-max-rounds 3" in w for w in warnings)


def test_fewer_groups_cut_to_what_the_trainer_splits_evenly(make_manager, lichen_log):
    # passes data indices 0, 3 (round 0) and 6 (round 1): 3 groups of 1 sample, 2 optimizer steps -> train on 2
    m = make_manager(
        "--dynamic-sampling-filter-path",
        "ds_plugins.keep_multiple_of_3",
        "--dynamic-sampling-max-rounds",
        "2",
        "--num-steps-per-rollout",
        "2",
        n=1,
    )
    groups, extra = m.generate(0)
    assert [g[0].metadata["prompt_index"] for g in groups] == [0, 3]
    assert [s.group_index for g in groups for s in g] == [0, 1]
    assert extra["rollout/dynamic_sampling_discarded_groups"] == 1
    assert any("cut by 1" in r.getMessage() for r in lichen_log if r.levelno == logging.WARNING)


def test_filter_returning_non_bool_is_a_user_error(make_manager):
    m = make_manager("--dynamic-sampling-filter-path", "ds_plugins.returns_none")
    with pytest.raises(UserError, match="--dynamic-sampling-filter-path 'ds_plugins.returns_none' returned NoneType"):
        m.generate(0)


def test_overlong_penalty_in_rollout(make_manager):
    # B = L = 6: penalty = -l / 6 for every response length l (hand formula, independent of shaping.py)
    m = make_manager("--overlong-buffer-len", "6", "--overlong-penalty-factor", "0.5", reward="ds_plugins.constant_one")
    groups, extra = m.generate(0)
    samples = [s for g in groups for s in g]
    for s in samples:
        assert s.reward == pytest.approx(1.0 - 0.5 * s.response_length / 6, abs=1e-12)
    assert extra["rollout/overlong_penalty_mean"] == pytest.approx(
        np.mean([-0.5 * s.response_length / 6 for s in samples])
    )


def test_overlong_penalty_skips_failed_and_shapes_the_reward_key(make_manager):
    m = make_manager("--overlong-buffer-len", "2", reward="ds_plugins.fail_odd")
    samples = [s for g in m.generate(0)[0] for s in g]
    for s in samples:
        if s.index % 2:
            assert s.status == Status.FAILED and s.reward == 0.0 and "overlong_penalty" not in s.metadata
        else:
            assert s.reward == pytest.approx(1.0 - min(1.0, max(0, s.response_length - 4) / 2))
    m = make_manager("--overlong-buffer-len", "6", "--reward-key", "acc", reward="ds_plugins.dict_reward")
    for s in (s for g in m.generate(0)[0] for s in g):
        assert s.reward["score"] == 1.0
        assert s.reward["acc"] == pytest.approx(0.5 - s.response_length / 6)


def test_end_to_end_train_with_dynamic_sampling(tiny_ckpt, addition_data, tmp_path):
    dumps = tmp_path / "dump_{rollout_id}.pt"
    argv = [
        "train",
        *_argv(tiny_ckpt, addition_data, n=4),
        "--dynamic-sampling-filter-path",
        BUILTIN,
        "--over-sampling-batch-size",
        "8",
        "--overlong-buffer-len",
        "2",
        "--lr",
        "1e-3",
        "--output-dir",
        str(tmp_path / "run"),
        "--no-progress",
        "--save-debug-rollout-data",
        str(dumps),
    ]
    assert main(argv) == 0
    files = sorted(glob.glob(str(tmp_path / "dump_*.pt")))
    assert len(files) == 2
    for path in files:
        groups = read_dump(path)["samples"]
        assert len(groups) == 4
        for gi, group in enumerate(groups):
            rewards = [d["reward"] for d in group]
            assert max(rewards) > min(rewards)  # every trained group carries reward spread
            assert all(math.isfinite(r) for r in rewards)
            assert [d["group_index"] for d in group] == [gi] * 4


# ---------------------------------------------------------------- flag validation


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--overlong-buffer-len", "0"], "--overlong-buffer-len 0"),
        (["--overlong-buffer-len", "7"], "--overlong-buffer-len 7"),  # > --rollout-max-response-len 6
        (["--overlong-penalty-factor", "0.5"], "--overlong-penalty-factor"),
        (["--overlong-buffer-len", "2", "--overlong-penalty-factor", "-1"], "--overlong-penalty-factor"),
        (["--overlong-buffer-len", "2", "--overlong-penalty-factor", "nan"], "--overlong-penalty-factor"),
        (["--over-sampling-batch-size", "8"], "--over-sampling-batch-size"),
        (["--dynamic-sampling-max-rounds", "3"], "--dynamic-sampling-max-rounds"),
        (
            ["--dynamic-sampling-filter-path", BUILTIN, "--over-sampling-batch-size", "3"],
            "--over-sampling-batch-size 3",
        ),
        (
            ["--dynamic-sampling-filter-path", BUILTIN, "--dynamic-sampling-max-rounds", "0"],
            "--dynamic-sampling-max-rounds 0",
        ),
        (
            ["--dynamic-sampling-filter-path", BUILTIN, "--dynamic-sampling-max-rounds", "1001"],
            "--dynamic-sampling-max-rounds 1001",
        ),
        (["--dynamic-sampling-filter-path", "ds_plugins.no_such_filter"], "--dynamic-sampling-filter-path"),
        (["--dynamic-sampling-filter-path", "no_such_module.f"], "--dynamic-sampling-filter-path"),
        (
            [
                "--dynamic-sampling-filter-path",
                BUILTIN,
                "--n-samples-per-prompt",
                "1",
                "--disable-rewards-normalization",
            ],
            f"--dynamic-sampling-filter-path {BUILTIN} needs --n-samples-per-prompt >= 2",
        ),
    ],
)
def test_flag_validation_names_the_flag(tiny_ckpt, addition_data, extra, flag):
    with pytest.raises(ConfigError) as err:
        _parse(_argv(tiny_ckpt, addition_data, *extra))
    assert flag in str(err.value)


def test_over_sampling_batch_size_defaults_to_rollout_batch_size(tiny_ckpt, addition_data):
    args = _parse(_argv(tiny_ckpt, addition_data, "--dynamic-sampling-filter-path", BUILTIN))
    assert args.over_sampling_batch_size == 4 and args.dynamic_sampling_max_rounds == 10
    assert args.overlong_buffer_len is None and args.overlong_penalty_factor == 1.0
    assert sampling.MAX_ROUNDS_LIMIT == SEED_ROUND_STRIDE  # round seed keys stay distinct across rollouts


def test_sampling_flags_are_checked_by_lichen_train(tiny_ckpt, addition_data, tmp_path, capsys):
    """The group is registered for validation: a bad value exits 2 before any model loads, naming the flag."""
    from lichen.config import validate

    assert sampling in validate.CHECK_ORDER, "lichen/config/validate.py: CHECK_ORDER must list `sampling` after rollout"
    argv = ["train", *_argv(tiny_ckpt, addition_data, "--overlong-buffer-len", "7"), "--output-dir", str(tmp_path)]
    assert main(argv) == 2
    assert "--overlong-buffer-len 7" in capsys.readouterr().err


def test_num_epoch_is_refused_with_dynamic_sampling(tmp_path):
    from lichen.config import parse_train_args
    from lichen.errors import ConfigError

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    argv = [
        "--hf-checkpoint",
        str(tmp_path / "m"),
        "--prompt-data",
        str(tmp_path / "p.jsonl"),
        "--rm-type",
        "exact",
        "--rollout-batch-size",
        "1",
        "--n-samples-per-prompt",
        "2",
        "--num-epoch",
        "1",
        "--dynamic-sampling-filter-path",
        "lichen.rollout.filters.check_reward_nonzero_std",
    ]
    with pytest.raises(ConfigError, match="--num-epoch"):
        parse_train_args(argv)
