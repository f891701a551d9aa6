"""lichen.algo.reduce: loss aggregation modes against loop references, and invariance to micro-batching."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from lichen.algo.reduce import LOSS_AGGREGATION_MODES, aggregate_loss, masked_mean

MAX_LEN = 7


def make_batch():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, MAX_LEN, generator=gen, dtype=torch.float64)
    lengths = [7, 3, 0, 5, 1, 6]  # sample 2 is all-masked (e.g. a failed sample)
    mask = (torch.arange(MAX_LEN)[None, :] < torch.tensor(lengths)[:, None]).double()
    mask[5, 2] = 0.0  # an interior hole
    x[mask == 0] = float("nan")  # garbage at masked positions must not leak into value or gradient
    return x, mask


def ref_loss(x, mask, mode, num_samples, num_tokens):
    """Python loops in float64 over the whole batch."""
    total = 0.0
    for b in range(x.shape[0]):
        vals = [x[b, t].item() for t in range(x.shape[1]) if mask[b, t] != 0]
        if mode == "seq-mean-token-mean":
            total += (sum(vals) / len(vals) if vals else 0.0) / num_samples
        elif mode == "token-mean":
            total += sum(vals) / num_tokens
        elif mode == "seq-mean-token-sum":
            total += sum(vals) / num_samples
        else:
            total += sum(vals) / MAX_LEN / num_samples
    return total


@pytest.mark.parametrize("mode", LOSS_AGGREGATION_MODES)
def test_value_matches_reference(mode):
    x, mask = make_batch()
    out = aggregate_loss(
        x, mask, mode, global_num_samples=6, global_num_tokens=int(mask.sum()), max_response_len=MAX_LEN
    )
    assert out.dim() == 0
    assert abs(out.item() - ref_loss(x, mask, mode, 6, int(mask.sum()))) < 1e-12


@pytest.mark.parametrize("mode", LOSS_AGGREGATION_MODES)
def test_micro_batching_gives_identical_value_and_gradients(mode):
    x0, mask = make_batch()
    kwargs = dict(global_num_samples=x0.shape[0], global_num_tokens=int(mask.sum()), max_response_len=MAX_LEN)
    results = []
    for micro in (x0.shape[0], 2, 1):
        x = x0.clone().requires_grad_()
        total = torch.zeros((), dtype=torch.float64)
        for start in range(0, x.shape[0], micro):
            part = aggregate_loss(x[start : start + micro], mask[start : start + micro], mode, **kwargs)
            part.backward()  # backward per micro-batch, as the trainer does
            total = total + part.detach()
        assert torch.isfinite(x.grad).all()
        results.append((total, x.grad.clone()))
    whole_value, whole_grad = results[0]
    assert torch.all(whole_grad[mask == 0] == 0)
    assert torch.all(whole_grad[2] == 0)  # the all-masked sample
    for value, grad in results[1:]:
        assert abs(value.item() - whole_value.item()) < 1e-6
        assert (grad - whole_grad).abs().max().item() < 1e-6


def test_gradient_of_seq_mean_token_mean_weights_tokens_per_sample():
    x = torch.zeros(2, 4, requires_grad=True)
    mask = torch.tensor([[1.0, 1, 1, 1], [1.0, 0, 0, 0]])
    aggregate_loss(x, mask, "seq-mean-token-mean", global_num_samples=2, global_num_tokens=5).backward()
    torch.testing.assert_close(x.grad, torch.tensor([[0.125] * 4, [0.5, 0, 0, 0]]))
    y = torch.zeros(2, 4, requires_grad=True)
    aggregate_loss(y, mask, "token-mean", global_num_samples=2, global_num_tokens=5).backward()
    torch.testing.assert_close(y.grad, mask / 5)


def test_all_masked_batch_is_zero_not_nan():
    x = torch.randn(3, 4, requires_grad=True)
    mask = torch.zeros(3, 4)
    for mode in LOSS_AGGREGATION_MODES:
        out = aggregate_loss(x, mask, mode, global_num_samples=0, global_num_tokens=0, max_response_len=4)
        assert out.item() == 0.0
        out.backward()
        assert torch.all(x.grad == 0)
        x.grad = None


def test_bad_arguments():
    x, mask = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="max_response_len"):
        aggregate_loss(x, mask, "seq-mean-token-sum-norm", global_num_samples=2, global_num_tokens=6)
    with pytest.raises(ValueError, match="unknown loss aggregation mode"):
        aggregate_loss(x, mask, "sum", global_num_samples=2, global_num_tokens=6)
    with pytest.raises(ValueError):
        aggregate_loss(x, mask[:, :2], "token-mean", global_num_samples=2, global_num_tokens=6)


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, float("nan")], [5.0, 6.0, 7.0], [float("inf"), 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), torch.tensor([1.5, 7.0, 0.0]))
    out = masked_mean(x, mask)
    torch.testing.assert_close(out, torch.tensor(10.0 / 3))
    out.backward()
    torch.testing.assert_close(x.grad, mask / 3)
    assert masked_mean(torch.ones(2, 2), torch.zeros(2, 2)).item() == 0.0


def test_algo_imports_nothing_of_lichen_above_it():
    code = (
        "import sys, lichen.algo; "
        "print(' '.join(sorted(m for m in sys.modules if m == 'lichen' or m.startswith('lichen.'))))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    allowed = {"lichen", "lichen.errors"}
    assert [m for m in loaded if m not in allowed and not m.startswith("lichen.algo")] == []
