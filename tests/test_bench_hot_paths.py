"""Hot-path changes of the performance round (issue 19), each with what it must keep exact.

Engine: a cache rebuild (join, compaction, growth) allocates the new KV cache uninitialised and zeroes only the
masked slots before each part's keys, instead of zero-filling the whole cache (~8% of W2's engine CPU time).
"""

from __future__ import annotations

import pytest
import torch

from lichen.engines.core import decode_batch
from lichen.engines.core.engine import Engine, GenRequest
from lichen.engines.core.sampler import derive_seed
from lichen.models.tiny import make_tiny_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tiny"))
    make_tiny_model(out, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, seed=0, init_std=0.2)
    return Engine.from_pretrained(out)


def _requests() -> list[GenRequest]:
    # ragged prompts (left padding) and lengths 1..40 (compactions, and growth past the first slots with
    # GROW_SLOTS lowered below), joined in chunks by max_batch_size (rebuilds on join)
    return [
        GenRequest(
            input_ids=[20 + i % 7] * (1 + i % 5),
            max_new_tokens=1 + (i * 7) % 40,
            temperature=0.8,
            seed=derive_seed(3, i),
            ignore_eos=True,
        )
        for i in range(12)
    ]


def test_rebuild_does_not_zero_fill_the_whole_cache(engine, monkeypatch):
    """The rebuild's cache tensors come from torch.empty; torch.zeros is never asked for a whole cache."""
    cfg = engine.model.cfg
    zero_shapes = []
    real_zeros = torch.zeros

    def recording_zeros(*shape, **kw):
        zero_shapes.append(tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape)
        return real_zeros(*shape, **kw)

    monkeypatch.setattr(decode_batch.torch, "zeros", recording_zeros)
    engine.generate(_requests())
    monkeypatch.undo()
    caches = [s for s in zero_shapes if len(s) == 4 and s[1] == cfg.num_kv_heads and s[3] == cfg.head_dim]
    assert caches == []


def test_garbage_in_uninitialised_memory_never_reaches_the_outputs(engine, monkeypatch):
    """With every torch.empty filled with NaN (what uninitialised memory may hold), outputs equal a normal run:
    no slot before the write position is left unwritten, and masked slots are zero (NaN * 0 = NaN otherwise)."""
    monkeypatch.setattr(decode_batch, "GROW_SLOTS", 8)  # several growth rebuilds within 40 tokens
    engine.max_batch_size = 5
    try:
        reference = engine.generate(_requests())
        real_empty = torch.empty

        def nan_empty(*shape, **kw):
            t = real_empty(*shape, **kw)
            return t.fill_(float("nan")) if t.is_floating_point() else t

        monkeypatch.setattr(torch, "empty", nan_empty)
        poisoned = engine.generate(_requests())
    finally:
        engine.max_batch_size = None
    assert [r.output_ids for r in poisoned] == [r.output_ids for r in reference]
    assert [r.output_logprobs for r in poisoned] == [r.output_logprobs for r in reference]
    assert all(len(r.output_ids) == q.max_new_tokens for r, q in zip(poisoned, _requests()))
