"""Engine prefill shares identical contexts (issue 19): the n samples of one prompt join a decode batch together,
and their prompt is prefilled once, its cache rows copied to every sample.

The reference is independent of batching: every request generated on its own, in float64 (where a batch of
other rows can change a logit by ~1e-16 at most, so tokens match exactly and log-probs to 1e-12).
"""

from __future__ import annotations

import pytest
import torch

from lichen.engines.core.engine import Engine, GenRequest
from lichen.engines.core.sampler import derive_seed
from lichen.models.tiny import make_tiny_model

PROMPTS = [[5, 9, 11, 4], [7, 3], [5, 9, 11, 4, 8, 2], [13]]  # ragged: the prefill is left-padded
SAMPLES = 4


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tiny"))
    make_tiny_model(out, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, seed=0, init_std=0.2)
    return Engine.from_pretrained(out, dtype=torch.float64)


def _requests(**kw) -> list[GenRequest]:
    return [
        GenRequest(input_ids=list(p), max_new_tokens=6 + j, temperature=1.0, seed=derive_seed(7, i, j), **kw)
        for i, p in enumerate(PROMPTS)
        for j in range(SAMPLES)
    ]


def _prefill_rows(engine, requests) -> tuple[list, list[int]]:
    """Run `engine.generate` and return (results, rows of every multi-position forward: the prefills)."""
    rows: list[int] = []
    model = engine.model
    original = type(model).forward

    def counting(self, input_ids, *args, **kwargs):
        if input_ids.shape[1] > 1:
            rows.append(input_ids.shape[0])
        return original(self, input_ids, *args, **kwargs)

    type(model).forward = counting
    try:
        return engine.generate(requests), rows
    finally:
        type(model).forward = original


def test_each_distinct_prompt_is_prefilled_once(engine):
    results, rows = _prefill_rows(engine, _requests())
    assert rows == [len(PROMPTS)]  # one prefill of 4 distinct prompts, not of 16 rows
    assert all(len(r.output_ids) >= 1 for r in results)


def test_shared_prefill_matches_each_request_alone(engine):
    batched = engine.generate(_requests())
    for req, got in zip(_requests(), batched):
        alone = engine.generate([req])[0]
        assert got.output_ids == alone.output_ids
        assert got.output_logprobs == pytest.approx(alone.output_logprobs, rel=0, abs=1e-12)
        assert got.finish_reason == alone.finish_reason


def test_shared_prefill_scores_every_prompt(engine):
    """Prompt log-probs (input_logprob_start) come from the shared row's hidden states, per sequence."""
    from lichen.engines.core.decode_batch import DecodeBatch, Seq

    seqs = [
        Seq(input_ids=list(p), max_new_tokens=0, input_logprob_start=0, temperature=t)
        for p in PROMPTS
        for t in (1.0, 0.5)
    ]
    DecodeBatch(engine.model).add(seqs, "0")
    for s in seqs:
        alone = Seq(input_ids=list(s.input_ids), max_new_tokens=0, input_logprob_start=0, temperature=s.temperature)
        DecodeBatch(engine.model).add([alone], "0")
        assert s.input_logprobs[0] is None and alone.input_logprobs[0] is None
        assert s.input_logprobs[1:] == pytest.approx(alone.input_logprobs[1:], rel=0, abs=1e-12)
