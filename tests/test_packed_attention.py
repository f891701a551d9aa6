"""Packed rows' attention segment by segment (lichen.models.packed_attention) against one SDPA call with the dense
block mask, and the layout against a naive per-pair rule."""

import pytest
import torch
import torch.nn.functional as F

from lichen.models.hf_model import _mask_segments
from lichen.models.packed_attention import PackedLayout, Unit, packed_attention
from lichen.train.micro_batches import StepBatch
from lichen.types import Sample

# row 0: a sample alone (5), a shared prompt (3) with parts 4, 0 and 2, padding to 16
# row 1: a shared prompt (1) with one part (6), a sample alone (2), padding
# row 2: padding only; row 3: a sample alone filling the row
LAYOUT = PackedLayout(
    16,
    (
        (Unit(0, 5), Unit(5, 3, (4, 0, 2))),
        (Unit(0, 1, (6,)), Unit(7, 2)),
        (),
        (Unit(0, 16),),
    ),
)


def naive_mask(layout: PackedLayout) -> torch.Tensor:
    """May query t attend to key s? Decided pair by pair from who owns each position."""
    T = layout.width
    out = torch.zeros((len(layout.rows), 1, T, T), dtype=torch.bool)
    for r, units in enumerate(layout.rows):
        owner = {}  # position -> (unit id, part id: -1 for the prompt / a sample alone)
        for u_id, u in enumerate(units):
            for t in range(u.start, u.start + u.prompt):
                owner[t] = (u_id, -1)
            off = u.start + u.prompt
            for j, n in enumerate(u.parts):
                for t in range(off, off + n):
                    owner[t] = (u_id, j)
                off += n
        for t in range(T):
            for s in range(T):
                a, b = owner.get(t, ("pad", -1)), owner.get(s, ("pad", -1))
                same = a == b and s <= t
                sees_prompt = a[0] == b[0] != "pad" and a[1] >= 0 and b[1] == -1
                out[r, 0, t, s] = same or sees_prompt
    return out


def test_dense_mask_is_the_naive_rule():
    assert torch.equal(LAYOUT.dense_mask(), naive_mask(LAYOUT))


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_segments_equal_one_call_with_the_dense_mask_float64(kv_heads):
    torch.manual_seed(0)
    rows, heads, T, D = len(LAYOUT.rows), 4, LAYOUT.width, 8
    q = torch.randn(rows, heads, T, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(rows, kv_heads, T, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(rows, kv_heads, T, D, dtype=torch.float64, requires_grad=True)
    gqa = kv_heads != heads
    w = torch.randn(rows, heads, T, D, dtype=torch.float64)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=LAYOUT.dense_mask(), enable_gqa=gqa)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    got = packed_attention(q, k, v, LAYOUT, enable_gqa=gqa)
    got_grads = torch.autograd.grad((got * w).sum(), (q, k, v))
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= 1e-12
    for g, r in zip(got_grads, ref_grads):
        assert (g - r).abs().max().item() <= 1e-12


def test_a_changed_key_outside_a_segment_changes_nothing_inside_it():
    """The part of row 1 (positions 1-6) sees its prompt (0) and itself, not the sample alone after it (7-8)."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(4, 2, 16, 8, dtype=torch.float64) for _ in range(3))
    base = packed_attention(q, k, v, LAYOUT)
    k2 = k.clone()
    k2[1, :, 7:9] += 1.0
    moved = packed_attention(q, k2, v, LAYOUT)
    assert torch.equal(moved[1, :, :7], base[1, :, :7]) and not torch.equal(moved[1, :, 7:9], base[1, :, 7:9])
    k3 = k.clone()
    k3[1, :, 0] += 1.0  # the prompt: its part sees it
    assert not torch.equal(packed_attention(q, k3, v, LAYOUT)[1, :, 1:7], base[1, :, 1:7])


def test_layout_rejects_units_that_do_not_follow_each_other():
    with pytest.raises(ValueError, match="does not follow position 5"):
        PackedLayout(16, ((Unit(0, 5), Unit(6, 2)),))
    with pytest.raises(ValueError, match="past the width"):
        PackedLayout(8, ((Unit(0, 5, (4,)),),))
    with pytest.raises(ValueError, match="q is"):
        packed_attention(*(torch.zeros(1, 2, 16, 8) for _ in range(3)), LAYOUT)


def test_segments_of_samples_alone_match_the_dense_masks():
    layout = PackedLayout(10, ((Unit(0, 3), Unit(3, 4)), (Unit(0, 10),), ()))
    assert layout.segments() == [(0, 3), (3, 4), (7, 3), (10, 10), (20, 10)]
    assert _mask_segments(layout.dense_mask()) == layout.segments()
    with pytest.raises(ValueError, match="shared prompt"):
        LAYOUT.segments()


def _sample(i: int, prompt: list[int], response: list[int]) -> Sample:
    return Sample(index=i, tokens=prompt + response, response_length=len(response))


def test_step_batch_lays_shared_prompts_as_units():
    """Samples 0-2 share a prompt, sample 3 has its own; a 1-token response is a zero-length part."""
    samples = [
        _sample(0, [5, 6, 7], [8, 9, 10]),
        _sample(1, [5, 6, 7], [11]),
        _sample(2, [5, 6, 7], [12, 13]),
        _sample(3, [1, 2], [3, 4, 5]),
    ]
    mb = StepBatch(samples, pad_id=0, share_prompts=True).micro([[0, 1, 2, 3]], "cpu")
    assert mb.attn_mask == PackedLayout(mb.input_ids.shape[1], ((Unit(0, 3, (2, 0, 1)), Unit(6, 4)),))
    assert mb.input_ids[0, :10].tolist() == [5, 6, 7, 8, 9, 12, 1, 2, 3, 4]
