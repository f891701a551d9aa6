"""The decode step computes live rows only (issue 19): a row that finishes leaves the batch at that step, in place
(the cache tensors keep their storage; only the moved rows are copied; slots only dropped rows used leave the
view), and results stay those of every request decoded on its own (float64: tokens exact, log-probs to 1e-12).
"""

from __future__ import annotations

import pytest
import torch

from lichen.engines.core.decode_batch import DecodeBatch, Seq
from lichen.engines.core.engine import Engine, GenRequest
from lichen.engines.core.sampler import derive_seed
from lichen.models.tiny import make_tiny_model

ROWS = 16  # one finished row is 1/16 of the batch: below any "wait until enough rows finished" threshold


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tiny"))
    make_tiny_model(out, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, seed=0, init_std=0.2)
    return Engine.from_pretrained(out, dtype=torch.float64)


def _seqs() -> list[Seq]:
    # the longest prompts finish first (row 12 before rows 13-15): their leading slots become nobody's
    return [
        Seq(input_ids=[5, 9, 11, 4][: 4 - i % 4], max_new_tokens=2 + i, seed=derive_seed(3, i)) for i in range(ROWS)
    ]


def test_finished_rows_leave_the_batch_at_once_and_in_place(engine):
    batch = DecodeBatch(engine.model)
    batch.add(_seqs(), "0")
    decode_rows: list[int] = []
    model = engine.model
    original = type(model).forward

    def counting(self, input_ids, *args, **kwargs):
        if input_ids.shape[1] == 1:
            decode_rows.append(input_ids.shape[0])
        return original(self, input_ids, *args, **kwargs)

    storage = batch.cache.k[0].untyped_storage().data_ptr()
    live_after: list[int] = []
    type(model).forward = counting
    try:
        while len(batch):
            batch.step("0")
            live_after.append(len(batch))
            if len(batch):
                assert len(batch.rows) == len(batch)  # no finished row kept in the batch
                assert all(s.finish is None for s in batch.rows)
                assert batch.cache.k[0].shape[0] == len(batch)
                assert bool(batch.key_valid[:, 0].any())  # attention reads no slot that only dropped rows used
                # the cache is the one the join built (GROW_SLOTS leaves room for every step here)
                assert batch.cache.k[0].untyped_storage().data_ptr() == storage
    finally:
        type(model).forward = original
    # each decode forward ran exactly the rows still live after the step before it
    assert decode_rows == [n for n in live_after if n]


def test_in_place_drops_match_each_request_alone(engine):
    """Stops at EOS and at the length limit, top-p / top-k and greedy rows, ragged prompts: rows leave at many
    different steps and the survivors are reordered; each must still get its solo tokens and log-probs."""
    eos = engine.eos_token_ids[0] if engine.eos_token_ids else 1
    reqs = [
        GenRequest(
            input_ids=[5, 9, 11, 4, 8][: 1 + i % 5],
            max_new_tokens=3 + 2 * i,
            temperature=0.0 if i % 7 == 3 else 1.0,
            top_p=0.9 if i % 3 == 1 else 1.0,
            top_k=5 if i % 4 == 2 else -1,
            stop_token_ids=[eos, 7 + i % 5],
            seed=derive_seed(11, i),
        )
        for i in range(ROWS)
    ]
    batched = engine.generate(reqs)
    assert len({len(r.output_ids) for r in batched}) > 4  # the rows really finished at different steps
    for req, got in zip(reqs, batched):
        alone = engine.generate([req])[0]
        assert got.output_ids == alone.output_ids
        assert got.output_logprobs == pytest.approx(alone.output_logprobs, rel=0, abs=1e-12)
        assert got.finish_reason == alone.finish_reason
