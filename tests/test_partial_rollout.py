"""Partial rollout (--partial-rollout, --mask-offpolicy-in-partial-rollout; Rollout servers issue, item 4).

- The buffer and the continuation rules, against hand-computed values.
- Whole steps through the real RolloutManager over a scripted engine-server stand-in (deterministic: which
  request finishes, which hangs until aborted and after how many tokens, which is never sent), so every buffered
  sample, continuation request, seed, mask and weight version is checked exactly.
- One run over real `lichen serve` engines: aborts mid-generation, resumed groups, and exact resume from a
  checkpoint whose buffer is not empty.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
from helpers.rollout import rollout_worker
from helpers.runs import THREADS, base_args, pop_engines, read_dump, run
from helpers.scripted_engines import ScriptedEngines, scripted_tokens

from lichen.config import parse_train_args
from lichen.config.rollout_config import SamplingConfig
from lichen.engines.clients.launcher import EngineLauncher
from lichen.engines.clients.remote_engines import RemoteEngines
from lichen.engines.core.engine import Engine, GenRequest, GenResult
from lichen.engines.core.sampler import derive_seed
from lichen.errors import ConfigError
from lichen.rollout.generate import SEED_ROUND_STRIDE
from lichen.rollout.partial import (
    SEGMENTS_KEY,
    PartialBuffer,
    continuation_request,
    extend_sample,
    offpolicy_loss_mask,
    to_buffered,
)
from lichen.train import checkpoint as ckpt
from lichen.types import Sample, Status

SEED = 1234  # --seed default


# The engine whose step the filter waits for (see ScriptedEngines.new_step's `sent`).
FILTER_WAITS_FOR: list = []


def keep_all(args, group) -> bool:
    # Deciding the first group waits until the scripted engine has received the requests the step sends before its
    # cut: otherwise a slow loop thread could let the driver cut the round before they are sent.
    for engine in FILTER_WAITS_FOR:
        engine.wait_sent()
    return True


# ---- the buffer and the continuation rules --------------------------------------------------------------------
def _sample(prompt_ids, response, *, status, versions, segments, logprobs=None) -> Sample:
    s = Sample(
        prompt="p",
        tokens=list(prompt_ids) + list(response),
        response_length=len(response),
        label="7",
        loss_mask=[1] * len(response),
        rollout_log_probs=logprobs or [-0.5] * len(response),
        status=status,
        weight_versions=list(versions),
        metadata={"prompt_index": 3, SEGMENTS_KEY: list(segments)},
    )
    return s


def _sampling() -> SamplingConfig:
    return SamplingConfig(
        n_samples_per_prompt=2,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        max_response_len=8,
        max_context_len=None,
        stop_token_ids=(4,),
        seed=SEED,
    )


def test_buffer_state_round_trips_through_json():
    buf = PartialBuffer()
    g1 = [
        _sample([5, 6], [7, 8, 9], status=Status.ABORTED, versions=["2"], segments=[3], logprobs=[-0.1, -1e-9, -3.0]),
        _sample([5, 6], [], status=Status.PENDING, versions=[], segments=[]),
    ]
    g2 = [_sample([1], [2], status=Status.COMPLETED, versions=["1"], segments=[1])]
    buf.put(g1)
    buf.put(g2)
    assert len(buf) == 2 and buf.num_tokens() == 4
    state = json.loads(json.dumps(buf.state_dict()))  # checkpoints store rollout state as JSON
    other = PartialBuffer()
    other.load_state_dict(state)
    assert [[s.to_dict() for s in g] for g in other.groups] == [[s.to_dict() for s in g] for g in (g1, g2)]
    assert other.groups[0][0].status is Status.ABORTED and other.groups[0][0].rollout_log_probs[1] == -1e-9
    assert [len(g) for g in other.take_all()] == [2, 1] and len(other) == 0
    old = PartialBuffer()
    old.load_state_dict(None)  # a checkpoint written before partial rollout existed
    assert len(old) == 0


def test_continuation_request_reduces_the_budget_and_keeps_sampling_settings():
    s = _sample([11, 12, 13], [20, 21], status=Status.ABORTED, versions=["0"], segments=[2])
    req = continuation_request(_sampling(), s, seed=99)
    assert req == GenRequest(
        input_ids=[11, 12, 13, 20, 21],
        max_new_tokens=6,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        stop_token_ids=[4],
        seed=99,
        return_sampling_mask=True,  # top-p / top-k truncate: the continuation's kept sets are replayed too
    )
    never_sent = _sample([11, 12, 13], [], status=Status.PENDING, versions=[], segments=[])
    assert continuation_request(_sampling(), never_sent, seed=1).max_new_tokens == 8
    done = _sample([11], [20, 4], status=Status.COMPLETED, versions=["0"], segments=[2])
    assert continuation_request(_sampling(), done, seed=1) is None
    full = _sample([11], [20] * 8, status=Status.ABORTED, versions=["0"], segments=[8])
    assert continuation_request(_sampling(), full, seed=1) is None and full.status is Status.TRUNCATED


def test_offpolicy_mask_per_segment():
    assert offpolicy_loss_mask([3, 2], ["0", "1"], True) == [0, 0, 0, 1, 1]
    assert offpolicy_loss_mask([3, 2], ["0", "1"], False) == [1] * 5
    assert offpolicy_loss_mask([1, 2, 2], ["0", "1", "2"], True) == [0, 0, 0, 1, 1]
    assert offpolicy_loss_mask([2, 2], ["1", "1"], True) == [1] * 4  # same weights: nothing off-policy
    assert offpolicy_loss_mask([], [], True) == []
    with pytest.raises(ValueError):
        offpolicy_loss_mask([3], ["0", "1"], True)


@pytest.mark.parametrize("mask", [True, False])
def test_extend_appends_a_segment(mask):
    s = _sample([11, 12], [20, 21, 22], status=Status.ABORTED, versions=["0"], segments=[3], logprobs=[-1, -2, -3])
    res = GenResult([30, 31], [-0.25, -0.5], "stop", 5, "1")
    out = extend_sample(s, res, lambda ids: ",".join(map(str, ids)), mask_offpolicy=mask)
    assert out.tokens == [11, 12, 20, 21, 22, 30, 31] and out.response_length == 5 and out.prompt_length == 2
    assert out.response == "20,21,22,30,31"
    assert out.rollout_log_probs == [-1, -2, -3, -0.25, -0.5]
    assert out.weight_versions == ["0", "1"] and out.metadata[SEGMENTS_KEY] == [3, 2]
    assert out.loss_mask == ([0, 0, 0, 1, 1] if mask else [1] * 5)
    assert out.status is Status.COMPLETED
    assert s.response_length == 3 and s.weight_versions == ["0"]  # the buffered sample itself is not changed
    empty = extend_sample(s, GenResult([], [], "abort", 5, "1"), str, mask_offpolicy=mask)
    assert empty.weight_versions == ["0"] and empty.metadata[SEGMENTS_KEY] == [3] and empty.status is Status.ABORTED


def test_to_buffered_statuses():
    fresh = Sample(tokens=[1, 2, 9], response_length=1, weight_versions=["3"], status=Status.TRUNCATED)
    assert to_buffered(fresh, "abort").status is Status.ABORTED and fresh.metadata[SEGMENTS_KEY] == [1]
    unsent = Sample(tokens=[1, 2], response_length=0, weight_versions=[""], status=Status.TRUNCATED)
    to_buffered(unsent, None)
    assert unsent.status is Status.PENDING and unsent.weight_versions == [] and unsent.metadata[SEGMENTS_KEY] == []
    done = to_buffered(Sample(tokens=[1, 3], response_length=1, weight_versions=["0"]), "stop")
    assert done.status is Status.COMPLETED


# ---- whole steps over a scripted engine-server stand-in ------------------------------------------------------------
@pytest.fixture
def scripted(tiny_ckpt, addition_data, tmp_path):
    made = []

    def make(*extra):
        argv = base_args(
            tiny_ckpt,
            addition_data,
            tmp_path / "o",
            "--num-rollout",
            "3",
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "2",
            "--over-sampling-batch-size",
            "4",
            "--dynamic-sampling-filter-path",
            "test_partial_rollout.keep_all",
            "--debug-rollout-only",
            "--rollout-external-engine-addrs",
            "127.0.0.1:9",
            "--partial-rollout",
            *extra,
        )
        engine = ScriptedEngines()
        manager = rollout_worker(parse_train_args(argv[1:]), engine=engine)
        made.append(engine)
        FILTER_WAITS_FOR.append(engine)
        return manager, engine

    yield make
    FILTER_WAITS_FOR.clear()
    for e in made:
        e.close()


def _prompt_ids(manager, data_index):
    return manager.encode(data_index, manager.data_source.source.records[data_index])


@pytest.mark.parametrize("mask", [True, False])
def test_cut_groups_are_buffered_and_continued_first(scripted, mask):
    manager, engine = scripted(*(["--mask-offpolicy-in-partial-rollout"] if mask else []))
    # step 0: round of prompts 0..3, requests (pos, j) in order. 0-3 answer; 4 = (2, 0) answers; 5 = (2, 1) hangs
    # after 3 tokens, 6 = (3, 0) after 0 tokens; 7 = (3, 1) waits behind them for a slot: never sent.
    engine.new_step({5: 3, 6: 0}, sent=7)
    groups, metrics = manager.generate(0)
    assert len(engine.received) == 7 and engine.aborts >= 1
    assert [[s.metadata["prompt_index"] for s in g] for g in groups] == [[0, 0], [1, 1]]
    assert all(SEGMENTS_KEY not in s.metadata and s.weight_versions == ["0"] for g in groups for s in g)
    assert manager.data_source.source.offset == 4
    assert metrics["rollout/partial_buffer_groups"] == 2 and metrics["rollout/partial_resumed_groups"] == 0
    assert metrics["rollout/dynamic_sampling_aborted_groups"] == 2
    buffered = manager.data_source.buffer.groups
    (b20, b21), (b30, b31) = buffered
    key0 = 0 * SEED_ROUND_STRIDE
    p2, p3 = _prompt_ids(manager, 2), _prompt_ids(manager, 3)
    full_20 = scripted_tokens(GenRequest(p2, 8, seed=derive_seed(SEED, key0, 2, 0)))
    assert (b20.status, b20.response_tokens, b20.weight_versions, b20.metadata[SEGMENTS_KEY]) == (
        Status.TRUNCATED,
        full_20,
        ["0"],
        [8],
    )
    part_21 = scripted_tokens(GenRequest(p2, 8, seed=derive_seed(SEED, key0, 2, 1)))[:3]
    assert (b21.status, b21.tokens, b21.weight_versions, b21.metadata[SEGMENTS_KEY], b21.rollout_log_probs) == (
        Status.ABORTED,
        p2 + part_21,
        ["0"],
        [3],
        [-0.5] * 3,
    )
    assert (b30.status, b30.tokens, b30.weight_versions, b30.metadata[SEGMENTS_KEY]) == (Status.ABORTED, p3, [], [])
    assert (b31.status, b31.tokens, b31.weight_versions, b31.metadata[SEGMENTS_KEY]) == (Status.PENDING, p3, [], [])
    assert all(s.reward is None for g in buffered for s in g)  # scored only once their group is decided

    # step 1 after a weight sync: round 0 = the 2 buffered groups, then prompts 4, 5 (0 from the manager's batch)
    state = json.loads(json.dumps(manager.state_dict()))
    engine.weight_version = "1"
    engine.new_step({4: 2, 5: 0}, sent=6)
    groups, metrics = manager.generate(1)
    key1 = 1 * SEED_ROUND_STRIDE
    p4, p5 = _prompt_ids(manager, 4), _prompt_ids(manager, 5)
    expected_requests = [
        GenRequest(p2 + part_21, 5, seed=derive_seed(SEED, key1, 0, 1)),  # (2, 0) finished: not sent again
        GenRequest(p3, 8, seed=derive_seed(SEED, key1, 1, 0)),
        GenRequest(p3, 8, seed=derive_seed(SEED, key1, 1, 1)),
        GenRequest(p4, 8, seed=derive_seed(SEED, key1, 2, 0)),
        GenRequest(p4, 8, seed=derive_seed(SEED, key1, 2, 1)),  # hangs after 2 tokens
        GenRequest(p5, 8, seed=derive_seed(SEED, key1, 3, 0)),  # hangs after 0; (5, 1) is never sent
    ]
    assert [(r.input_ids, r.max_new_tokens, r.seed) for r in engine.received] == [
        (r.input_ids, r.max_new_tokens, r.seed) for r in expected_requests
    ]
    assert all((r.temperature, r.top_p, r.top_k) == (1.0, 1.0, -1) for r in engine.received)
    assert [[s.metadata["prompt_index"] for s in g] for g in groups] == [[2, 2], [3, 3]]
    assert [[s.index for s in g] for g in groups] == [[0, 1], [2, 3]]
    g20, g21 = groups[0]
    assert g20.tokens == b20.tokens and g20.weight_versions == ["0"] and g20.loss_mask == [1] * 8
    cont = scripted_tokens(expected_requests[0])
    assert g21.tokens == p2 + part_21 + cont and g21.response_length == 8 and g21.status is Status.TRUNCATED
    assert g21.weight_versions == ["0", "1"] and g21.metadata[SEGMENTS_KEY] == [3, 5]
    assert g21.rollout_log_probs == [-0.5] * 3 + [-0.25] * 5
    assert g21.loss_mask == ([0] * 3 + [1] * 5 if mask else [1] * 8)
    for j, s in enumerate(groups[1]):
        assert s.response_tokens == scripted_tokens(expected_requests[1 + j]) and s.weight_versions == ["1"]
        assert s.metadata[SEGMENTS_KEY] == [8] and s.loss_mask == [1] * 8
    assert all(isinstance(s.reward, float) for g in groups for s in g)
    assert manager.data_source.source.offset == 6  # 4 + the 2 new prompts of this step
    assert metrics["rollout/partial_resumed_groups"] == 2
    assert metrics["rollout/partial_resumed_tokens"] == 8 + 3
    assert metrics["rollout/partial_buffer_groups"] == 2
    assert [[s.metadata["prompt_index"] for s in g] for g in manager.data_source.buffer.groups] == [[4, 4], [5, 5]]
    assert [s.response_length for g in manager.data_source.buffer.groups for s in g] == [8, 2, 0, 0]

    # exact resume: a manager loaded from the step-0 state makes the same requests and the same groups
    other, engine2 = scripted(*(["--mask-offpolicy-in-partial-rollout"] if mask else []))
    other.load_state_dict(state)
    engine2.weight_version = "1"
    engine2.new_step({4: 2, 5: 0}, sent=6)
    again, _ = other.generate(1)
    assert [r.seed for r in engine2.received] == [r.seed for r in engine.received]
    assert [[s.to_dict() for s in g] for g in again] == [[s.to_dict() for s in g] for g in groups]
    assert other.data_source.buffer.state_dict() == manager.data_source.buffer.state_dict()
    assert other.data_source.source.state_dict() == manager.data_source.source.state_dict()


def test_buffered_groups_beyond_the_round_shrink_the_new_prompts(scripted):
    """Round 0 holds the buffered groups first; the manager's batch and the round's extra prompts shrink by their
    number (here 3 buffered groups with --rollout-batch-size 2: no new prompt at all, the round is the buffer)."""
    manager, engine = scripted()
    for i in range(3):
        ids = _prompt_ids(manager, 10 + i)
        manager.data_source.buffer.put(
            [
                to_buffered(Sample(prompt="q", tokens=list(ids), metadata={"prompt_index": 10 + i}), None)
                for _ in range(2)
            ]
        )
    engine.new_step({})
    groups, metrics = manager.generate(0)
    assert manager.data_source.source.offset == 1  # 4 per round - 3 buffered groups
    assert [g[0].metadata["prompt_index"] for g in groups] == [10, 11]
    assert [g[0].metadata["prompt_index"] for g in manager.data_source.buffer.groups] == [12, 0]
    assert metrics["rollout/partial_resumed_groups"] == 3 and metrics["rollout/partial_resumed_tokens"] == 0


def test_old_checkpoint_and_flag_off_loads(scripted, tiny_ckpt, addition_data, tmp_path):
    manager, _ = scripted()
    manager.load_state_dict(
        {"source": manager.data_source.source.state_dict()}
    )  # written before partial rollout existed
    assert len(manager.data_source.buffer) == 0 and "partial_rollout" in manager.state_dict()
    manager.data_source.buffer.put([to_buffered(Sample(tokens=[1, 2]), None)])
    state = manager.state_dict()
    argv = base_args(tiny_ckpt, addition_data, tmp_path / "o2", "--num-rollout", "1", "--debug-rollout-only")
    plain = rollout_worker(parse_train_args(argv[1:]), engine=ScriptedEngines())
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("lichen").addHandler(handler)
    try:
        plain.load_state_dict(state)
    finally:
        logging.getLogger("lichen").removeHandler(handler)
        plain.engine.close()
    assert len(plain.data_source.buffer) == 0
    assert any("--partial-rollout is off" in r.getMessage() for r in records)


def test_manager_refuses_an_engine_that_cannot_abort(tiny_ckpt, addition_data, tmp_path):
    argv = base_args(
        tiny_ckpt,
        addition_data,
        tmp_path / "o",
        "--num-rollout",
        "1",
        "--debug-rollout-only",
        "--dynamic-sampling-filter-path",
        "test_partial_rollout.keep_all",
        "--partial-rollout",
        "--rollout-external-engine-addrs",
        "127.0.0.1:9",
    )
    with pytest.raises(ConfigError, match="--partial-rollout needs engine servers that can abort"):
        rollout_worker(parse_train_args(argv[1:]), engine=Engine.from_pretrained(tiny_ckpt))


# ---- over real `lichen serve` engines -------------------------------------------------------------------------
MAX_LEN = 48


@pytest.fixture(scope="module")
def serve_pair(tiny_ckpt, tmp_path_factory):
    """Two servers decoding at most 2 sequences at once: a round of 12 requests runs in waves, so the requests
    running when the first 2 groups are decided are cut off mid-generation."""
    # keyed=False: the runs below use them as external engines without a key (test_sync_training covers keys)
    launcher = EngineLauncher(
        tiny_ckpt,
        2,
        server_args=[*THREADS, "--max-batch-size", "2", "--weight-dir", str(tmp_path_factory.getbasetemp())],
        log_dir=str(tmp_path_factory.mktemp("logs")),
        keyed=False,
    )
    urls = launcher.start()
    yield [u.split("//")[1] for u in urls]
    launcher.stop()


def _dump(template: str, rollout_id: int) -> list[list[dict]]:
    return read_dump(template.format(rollout_id=rollout_id))["samples"]


def _rollout_state(save_dir: str, rollout_id: int) -> dict:
    return ckpt.load_rollout_state(save_dir, rollout_id)


@pytest.mark.slow
def test_partial_rollout_over_lichen_serve_with_exact_resume(
    serve_pair, tiny_ckpt, addition_data, tmp_path, monkeypatch
):
    recorded: list[tuple] = []  # (input_ids, max_new_tokens, finish_reason, tokens generated) per request
    orig = RemoteEngines.agenerate

    async def recording(self, request, *a, **kw):
        res = await orig(self, request, *a, **kw)
        recorded.append((list(request.input_ids), request.max_new_tokens, res.finish_reason, len(res.output_ids)))
        return res

    monkeypatch.setattr(RemoteEngines, "agenerate", recording)
    common = [
        "--num-rollout",
        "3",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--over-sampling-batch-size",
        "6",
        "--rollout-max-response-len",
        str(MAX_LEN),
        "--dynamic-sampling-filter-path",
        "test_partial_rollout.keep_all",
        "--partial-rollout",
        "--mask-offpolicy-in-partial-rollout",
        "--rollout-external-engine-addrs",
        *serve_pair,
        "--update-weight-transport",
        "disk",
    ]
    save = str(tmp_path / "save")
    dump_a = str(tmp_path / "a" / "r_{rollout_id}.pt")
    rows = run(
        base_args(
            tiny_ckpt,
            addition_data,
            tmp_path / "a",
            *common,
            "--update-weight-disk-dir",
            str(tmp_path / "wa"),
            "--save",
            save,
            "--save-interval",
            "2",
            "--save-debug-rollout-data",
            dump_a,
        )
    )
    assert any(fin == "abort" and got > 0 for _, _, fin, got in recorded), "no request was cut mid-generation"

    trained = [_dump(dump_a, i) for i in range(3)]
    seen: list[int] = []
    for step, groups in enumerate(trained):
        assert len(groups) == 2
        for g in groups:
            assert len(g) == 2 and len({s["metadata"]["prompt_index"] for s in g}) == 1  # exactly n, one prompt
            assert len({tuple(s["tokens"]) for s in g}) == 2
            seen.append(g[0]["metadata"]["prompt_index"])
            for s in g:
                assert 0 < s["response_length"] <= MAX_LEN and len(s["loss_mask"]) == s["response_length"]
                assert len(s["rollout_log_probs"]) == s["response_length"]
                segs = s["metadata"].get(SEGMENTS_KEY, [s["response_length"]])
                assert sum(segs) == s["response_length"] and len(segs) == len(s["weight_versions"])
                last = s["weight_versions"][-1]
                assert s["loss_mask"] == [
                    int(v == last) for n_, v in zip(segs, s["weight_versions"]) for _ in range(n_)
                ]
                # one entry per segment, oldest first; a sample finished before its group was cut keeps its version
                assert [int(v) for v in s["weight_versions"]] == sorted(int(v) for v in s["weight_versions"])
                assert int(last) <= step
    assert len(set(seen)) == len(seen)  # no prompt trained twice
    # every prompt taken from the source is trained or still buffered: nothing lost, nothing duplicated
    final = _rollout_state(save, 2)
    buffered = [g[0]["metadata"]["prompt_index"] for g in final["partial_rollout"]["groups"]]
    assert all(len(g) == 2 for g in final["partial_rollout"]["groups"])
    assert sorted(seen + buffered) == list(range(final["source"]["offset"]))
    assert [m["rollout/partial_resumed_groups"] for m in rows] == [0, 4, 4]
    assert [m["rollout/partial_buffer_groups"] for m in rows] == [4, 4, 4]

    # steps 2 and 3 train the first two buffered groups, continued with the budget they had left
    resumed_two_versions = 0
    for rollout_id in (1, 2):
        # the buffer saved after step 2 (checkpoints are written after steps 2 and 3 only)
        before = _rollout_state(save, 1)["partial_rollout"]["groups"] if rollout_id == 2 else None
        for g in trained[rollout_id]:
            for s in g:
                segs = s["metadata"][SEGMENTS_KEY]
                prompt_len = len(s["tokens"]) - s["response_length"]
                versions = [int(v) for v in s["weight_versions"]]
                assert versions == sorted(set(versions))  # one segment per step that added tokens
                resumed_two_versions += len(versions) >= 2
                sent = [(ids, m) for ids, m, _, _ in recorded]
                for i in range(1, len(segs)):  # each continuation: prompt + what came before, budget reduced by it
                    done = sum(segs[:i])
                    assert (s["tokens"][: prompt_len + done], MAX_LEN - done) in sent
        if before is not None:
            assert [g[0]["metadata"]["prompt_index"] for g in trained[rollout_id]] == [
                g[0]["metadata"]["prompt_index"] for g in before[:2]
            ]
            for g, b in zip(trained[rollout_id], before):
                for s, old in zip(g, b):
                    assert s["tokens"][: len(old["tokens"])] == old["tokens"]  # continued, not regenerated
    assert resumed_two_versions > 0, "no trained sample spans two weight versions"

    # exact resume: load the checkpoint after step 2 (4 groups buffered) and run step 3 again
    load = tmp_path / "load"
    shutil.copytree(ckpt.iter_dir(save, 1), ckpt.iter_dir(str(load), 1))
    (load / ckpt.LATEST).write_text("1")
    assert len(_rollout_state(str(load), 1)["partial_rollout"]["groups"]) == 4
    dump_b = str(tmp_path / "b" / "r_{rollout_id}.pt")
    run(
        base_args(
            tiny_ckpt,
            addition_data,
            tmp_path / "b",
            *common,
            "--update-weight-disk-dir",
            str(tmp_path / "wb"),
            "--load",
            str(load),
            "--save-debug-rollout-data",
            dump_b,
        )
    )
    assert not os.path.exists(dump_b.format(rollout_id=1))  # only step 3 ran
    # The step-3 groups trained come from the saved buffer: same requests, seeds and weights, so the same tokens
    # (log-probs up to batch rounding). Groups newly cut off in step 3 depend on timing (how far each request got
    # before the abort reached it) and are not compared.
    a, b = trained[2], _dump(dump_b, 2)
    for ga, gb in zip(a, b):
        for x, y in zip(ga, gb):
            lp_x, lp_y = x.pop("rollout_log_probs"), y.pop("rollout_log_probs")
            # each run launched its own servers (other URLs), so only the number of calls that made it compares
            served_x, served_y = pop_engines(x), pop_engines(y)
            assert served_x and len(served_x) == len(served_y)
            assert x == y
            assert max(abs(p - q) for p, q in zip(lp_x, lp_y)) <= 1e-5


def test_a_stopped_launcher_refuses_to_restart(tiny_ckpt):
    """health.restart_engine goes through EngineLauncher.restart: once stop() began, nothing new is started (a
    restart racing with shutdown would leave a server nobody stops)."""
    from lichen.engines.clients.launcher import EngineLaunchError

    launcher = EngineLauncher(tiny_ckpt, 1)
    launcher.stop()
    with pytest.raises(EngineLaunchError, match="cannot restart engine 0: the engine launcher is stopped"):
        launcher.restart(0)
    assert launcher.servers == []
