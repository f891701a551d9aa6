"""Continuous batching (lichen/engines/core/decode_batch.py, scheduler.py) in process: sequences that join a running batch,
leave it, are retracted or aborted still get the tokens and log-probs they would get alone."""

import threading

import pytest
import torch

from lichen.engines.core import decode_batch as batch_mod
from lichen.engines.core.decode_batch import Seq
from lichen.engines.core.engine import Engine, GenRequest
from lichen.engines.core.sampler import derive_seed, row_noise, sample_rows
from lichen.engines.server.scheduler import Scheduler


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls on a busy 2-core machine run far faster on one thread than two contending ones."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def engine(tiny_ckpt, one_thread):
    return Engine.from_pretrained(tiny_ckpt)


def full_forward_logprobs(model, ids, temperature):
    """log p(ids[k] | ids[:k]) for k >= 1 from one full forward, in float64 after the fp32 logits."""
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model.logits(model(x, torch.arange(len(ids))[None]))[0].double() / temperature
    lp = torch.log_softmax(logits, -1)
    return [lp[k - 1, t].item() for k, t in enumerate(ids) if k > 0]


def seq(ids, n, seed, t=0.8, **kw):
    return Seq(input_ids=list(ids), max_new_tokens=n, temperature=t, seed=seed, **kw)


def test_a_rows_noise_and_token_do_not_depend_on_its_batch():
    seeds = torch.tensor([5, 9, 5, 123456789])
    steps = torch.tensor([0, 3, 7, 2**33 + 5])  # steps wrap mod 2^32
    u = row_noise(seeds, steps, 40)
    for b in range(4):
        assert torch.equal(u[b], row_noise(seeds[b : b + 1], steps[b : b + 1], 40)[0])
    assert torch.equal(u[3], row_noise(seeds[3:], torch.tensor([5]), 40)[0])
    assert not torch.equal(u[0], u[2])  # same seed, another step
    logits = torch.randn(4, 40)
    args = (torch.full((4,), 0.9), torch.full((4,), 0.95), torch.full((4,), -1), seeds)
    tok, lp, _ = sample_rows(logits, *args, steps)
    for b in range(4):
        one = sample_rows(logits[b : b + 1], *(a[b : b + 1] for a in args), steps[b : b + 1])
        assert torch.equal(tok[b : b + 1], one[0]) and torch.equal(lp[b : b + 1], one[1])


def run_staggered(engine, seqs, joins):
    """Drive a DecodeBatch: seqs[i] joins before step joins[i]; returns when all have finished."""
    b = engine.new_batch()
    step = 0
    while any(s.finish is None for s in seqs):
        newcomers = [s for s, at in zip(seqs, joins) if at == step]
        if newcomers:
            b.add(newcomers, "v")
        b.step("v")
        step += 1
    return b


def test_joining_a_running_batch_gives_the_solo_tokens_and_exact_logprobs(engine, monkeypatch):
    """Rows join at different steps, with prompts longer and shorter than the batch's filled length (so the
    batch shifts right), finish at different times; a tiny GROW_SLOTS forces many cache rebuilds."""
    monkeypatch.setattr(batch_mod, "GROW_SLOTS", 3)
    prompts = [[7, 8, 9], [10] * 12, [11, 12], list(range(13, 30)), [30]]
    lens = [20, 9, 14, 6, 17]
    joins = [0, 2, 2, 5, 11]
    seqs = [seq(p, n, derive_seed(1, i), stop_ids=frozenset()) for i, (p, n) in enumerate(zip(prompts, lens))]
    run_staggered(engine, seqs, joins)
    diffs = []
    for s, p, n in zip(seqs, prompts, lens):
        assert len(s.output_ids) == n and s.finish == ("length", n)
        alone = engine.generate([GenRequest(p, n, temperature=0.8, seed=s.seed, ignore_eos=True)])[0]
        assert s.output_ids == alone.output_ids
        ref = full_forward_logprobs(engine.model, p + s.output_ids, 0.8)[len(p) - 1 :]
        diffs += [abs(a - b) for a, b in zip(s.output_logprobs, ref)]
    assert max(diffs) <= 1e-5, max(diffs)


def test_retracted_sequence_resumes_with_the_same_tokens(engine):
    a = seq([40, 41, 42], 15, 77, stop_ids=frozenset())
    b = seq([43, 44], 15, 78, stop_ids=frozenset())
    batch = engine.new_batch()
    batch.add([a, b], "v1")
    for _ in range(6):
        batch.step("v1")
    out = batch.retract()
    assert len(batch) == 0 and {id(x) for x in out} == {id(a), id(b)} and a.num_retractions == 1
    batch.add(out, "v2")  # recomputes the cache from prompt + output so far
    while len(batch):
        batch.step("v2")
    for s in (a, b):
        alone = engine.generate([GenRequest(s.input_ids, 15, temperature=0.8, seed=s.seed, ignore_eos=True)])[0]
        assert s.output_ids == alone.output_ids
        assert [v[0] for v in s.versions] == ["v1", "v2"] and s.versions[0][1:] == [0, 6]
        assert s.versions[1][2] == 15 and s.finish_version == "v2"


def test_abort_keeps_partial_output_and_spares_the_others(engine):
    a, b = seq([50, 51], 30, 1, stop_ids=frozenset()), seq([52], 10, 2, stop_ids=frozenset())
    batch = engine.new_batch()
    batch.add([a, b], "0")
    for _ in range(4):
        batch.step("0")
    batch.abort([a], "stop it", "0")
    assert a.finish == ("abort", "stop it") and len(a.output_ids) == 4
    while len(batch):
        batch.step("0")
    alone = engine.generate([GenRequest([52], 10, temperature=0.8, seed=2, ignore_eos=True)])[0]
    assert b.output_ids == alone.output_ids and len(a.output_ids) == 4


def test_prompt_scoring_matches_full_forward(engine):
    ids = [60, 61, 62, 63, 64, 65, 66]
    s0 = seq(ids, 0, 0, t=0.5, input_logprob_start=0, top_logprobs_num=3, token_ids_logprob=[5, 9])
    s3 = seq(ids[:5], 2, 0, t=0.5, input_logprob_start=3)
    batch = engine.new_batch()
    done = batch.add([s0, s3], "0")
    assert done == [s0] and s0.finish == ("length", 0) and s0.output_ids == []
    ref = full_forward_logprobs(engine.model, ids, 0.5)
    assert s0.input_logprobs[0] is None and len(s0.input_logprobs) == len(ids)
    assert max(abs(a - b) for a, b in zip(s0.input_logprobs[1:], ref)) <= 1e-5
    assert s3.input_logprobs[0] is None and s3.input_logprobs[1:] == pytest.approx(ref[3:4], abs=1e-5)  # SGLang
    top = s0.input_top[3]
    assert len(top) == 3 and top[0][0] >= top[1][0] >= top[2][0] and s0.input_top[0] is None
    assert max(lp for lp, _ in top) >= s0.input_logprobs[3]
    picked = dict((t, lp) for lp, t in s0.input_ids_lp[1])
    assert set(picked) == {5, 9}


def test_stop_strings_and_stop_ids(engine):
    probe = seq([70, 71], 12, 5, t=0, stop_ids=frozenset())
    b = engine.new_batch()
    b.add([probe], "0")
    while len(b):
        b.step("0")
    target = probe.output_ids[4]
    by_id = seq([70, 71], 12, 5, t=0, stop_ids=frozenset({target}))
    by_text = seq([70, 71], 12, 5, t=0, stop_strings=("<stop>",))
    b = engine.new_batch(stop_text=lambda s: "<stop>" if len(s.output_ids) == 3 else None)
    b.add([by_id, by_text], "0")
    while len(b):
        b.step("0")
    first = probe.output_ids.index(target)
    assert by_id.finish == ("stop", target) and by_id.output_ids == probe.output_ids[: first + 1]
    assert by_text.finish == ("stop", "<stop>") and len(by_text.output_ids) == 3


def test_scheduler_joins_concurrent_submissions_and_serialises_exclusive_calls(engine):
    """Sequences submitted while others decode join the running batch; an exclusive call (a weight update)
    runs only once the batch has drained, and nothing is admitted meanwhile."""
    done, lock, seen = [], threading.Lock(), []
    finished = threading.Event()

    def on_events(progress, fin):
        with lock:
            done.extend(fin)
            if len(done) == 4:
                finished.set()

    sch = Scheduler(engine, max_running=8, on_events=on_events)
    sch.start()
    try:
        first = [seq([80 + i], 40, i, stop_ids=frozenset()) for i in range(2)]
        sch.submit(first)
        while not sch.num_running:
            pass
        later = [seq([90 + i], 5, 10 + i, stop_ids=frozenset()) for i in range(2)]
        fut = sch.call(
            lambda s: seen.append((s.num_running, [len(x.output_ids) for x in first + later])), exclusive=True
        )
        sch.submit(later)
        fut.result(timeout=30)
        # It ran after the batch drained, and before the later ones were admitted.
        assert seen == [(0, [40, 40, 0, 0])]
        assert finished.wait(30)
        assert all(len(s.output_ids) == 5 for s in later)
    finally:
        sch.stop()
    assert not sch.alive()
