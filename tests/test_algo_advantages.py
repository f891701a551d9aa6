"""lichen.algo.advantages against naive float64 references (Python loops, serial recurrences, hand-checked values)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from lichen.algo.advantages import (
    broadcast_to_tokens,
    discounted_returns,
    gae_advantages,
    group_normalized_rewards,
    reinforce_plus_plus_token_rewards,
    rloo_advantages,
    whiten,
)

# ---------------------------------------------------------------------------------------------------------------
# references


def ref_group_norm(rewards, groups, valid, normalize, std_normalize, eps):
    """Plain-Python GRPO over lists."""
    out = [0.0] * len(rewards)
    small = 0
    for g in sorted(set(groups)):
        members = [i for i, gi in enumerate(groups) if gi == g and valid[i]]
        if len(members) < 2:
            small += 1
        if not normalize:
            for i in members:
                out[i] = rewards[i]
            continue
        if len(members) < 2:
            continue
        vals = [rewards[i] for i in members]
        mean = sum(vals) / len(vals)
        std = statistics.stdev(vals)  # unbiased
        for i in members:
            out[i] = (rewards[i] - mean) / (std + eps) if std_normalize else rewards[i] - mean
    return out, small


def ref_rloo(rewards, groups, valid):
    out = [0.0] * len(rewards)
    small = 0
    for g in sorted(set(groups)):
        members = [i for i, gi in enumerate(groups) if gi == g and valid[i]]
        if len(members) < 2:
            small += 1
            continue
        for i in members:
            others = [rewards[j] for j in members if j != i]
            out[i] = rewards[i] - sum(others) / len(others)
    return out, small


def serial_returns(r, m, gamma):
    """G_t = r_t + gamma G_next over valid positions; masked positions pass G through. float64, loop over t."""
    r, m = r.double(), m != 0
    out = torch.zeros_like(r)
    g = torch.zeros(r.shape[0], dtype=torch.float64)
    for t in range(r.shape[1] - 1, -1, -1):
        g = torch.where(m[:, t], r[:, t] + gamma * g, g)
        out[:, t] = torch.where(m[:, t], g, torch.zeros_like(g))
    return out


def serial_gae(r, v, m, gamma, lambd):
    r, v, m = r.double(), v.double(), m != 0
    adv = torch.zeros_like(r)
    next_v = torch.zeros(r.shape[0], dtype=torch.float64)
    next_a = torch.zeros(r.shape[0], dtype=torch.float64)
    for t in range(r.shape[1] - 1, -1, -1):
        delta = r[:, t] + gamma * next_v - v[:, t]
        a = delta + gamma * lambd * next_a
        next_a = torch.where(m[:, t], a, next_a)
        next_v = torch.where(m[:, t], v[:, t], next_v)
        adv[:, t] = torch.where(m[:, t], a, torch.zeros_like(a))
    return adv, torch.where(m, adv + v, torch.zeros_like(adv))


def right_padded_mask(lengths, length):
    return (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]).float()


def holey_mask(gen, batch, length):
    """Right-padded random lengths, plus interior holes (e.g. tool output) and one all-masked row."""
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    lengths[0] = length
    lengths[1] = 0
    mask = right_padded_mask(lengths.tolist(), length)
    holes = torch.rand(batch, length, generator=gen) < 0.1
    mask[2:] = mask[2:] * (~holes[2:]).float()
    return mask


# ---------------------------------------------------------------------------------------------------------------
# GRPO / RLOO


def test_grpo_hand_example():
    adv, small = group_normalized_rewards(
        torch.tensor([1.0, 0, 0, 0]), torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.bool)
    )
    # mean 0.25, unbiased std = sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5
    torch.testing.assert_close(adv, torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-5, rtol=0)
    assert small == 0


@pytest.mark.parametrize("normalize,std_normalize", [(True, True), (True, False), (False, True)])
def test_grpo_matches_loop_reference(normalize, std_normalize):
    gen = torch.Generator().manual_seed(0)
    batch = 60
    # non-contiguous, shuffled group ids; some groups all failed or with a single valid sample
    groups = torch.tensor([[100, 7, 42, 9000, 5][i % 5] for i in range(batch)])[torch.randperm(batch, generator=gen)]
    rewards = torch.randn(batch, generator=gen, dtype=torch.float64)
    valid = torch.rand(batch, generator=gen) > 0.2
    valid[groups == 9000] = False
    only = (groups == 5).nonzero().flatten()
    valid[only] = False
    valid[only[0]] = True
    rewards[~valid] = float("nan")  # failed samples may carry garbage; it must not leak
    adv, small = group_normalized_rewards(
        rewards, groups, valid, normalize=normalize, std_normalize=std_normalize, eps=1e-6
    )
    ref, ref_small = ref_group_norm(rewards.tolist(), groups.tolist(), valid.tolist(), normalize, std_normalize, 1e-6)
    assert small == ref_small == 2
    torch.testing.assert_close(adv, torch.tensor(ref, dtype=torch.float64), atol=1e-12, rtol=1e-10)
    assert adv.dtype == torch.float64
    assert torch.all(adv[~valid] == 0)


def test_grpo_single_valid_and_constant_groups():
    rewards = torch.tensor([3.0, 1.0, 1.0, 2.0, 2.0, 2.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    valid = torch.tensor([True, False, False, False, True, True])
    adv, small = group_normalized_rewards(rewards, groups, valid)
    # group 0: one valid -> 0; group 1: none valid -> 0; group 2: constant -> 0 (std 0, no NaN)
    assert torch.equal(adv, torch.zeros(6))
    assert small == 2
    raw, small_raw = group_normalized_rewards(rewards, groups, valid, normalize=False)
    assert torch.equal(raw, torch.tensor([3.0, 0, 0, 0, 2.0, 2.0]))
    assert small_raw == 2


def test_grpo_rejects_shape_mismatch():
    with pytest.raises(ValueError):
        group_normalized_rewards(torch.zeros(3), torch.zeros(4, dtype=torch.long), torch.ones(3, dtype=torch.bool))


def test_rloo_hand_example_and_reference():
    adv, small = rloo_advantages(
        torch.tensor([1.0, 0, 0, 0]), torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.bool)
    )
    torch.testing.assert_close(adv, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))
    assert small == 0

    gen = torch.Generator().manual_seed(1)
    groups = torch.randint(0, 7, (50,), generator=gen) * 3
    rewards = torch.randn(50, generator=gen, dtype=torch.float64)
    valid = torch.rand(50, generator=gen) > 0.3
    valid[groups == 0] = False
    adv, small = rloo_advantages(rewards, groups, valid)
    ref, ref_small = ref_rloo(rewards.tolist(), groups.tolist(), valid.tolist())
    assert small == ref_small >= 1
    torch.testing.assert_close(adv, torch.tensor(ref, dtype=torch.float64), atol=1e-12, rtol=1e-10)


def test_broadcast_to_tokens():
    mask = right_padded_mask([3, 1, 0], 4)
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0, 5.0]), mask)
    assert torch.equal(out, torch.tensor([[2.0, 2, 2, 0], [-1, 0, 0, 0], [0, 0, 0, 0]]))


# ---------------------------------------------------------------------------------------------------------------
# discounted returns / GAE


def test_discounted_returns_hand_example():
    r = torch.tensor([[1.0, 0.0, 2.0, 9.0], [0.0, 1.0, 7.0, 7.0]])
    m = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    g = discounted_returns(r, m, 0.5)
    # row 0: G2 = 2, G1 = 0 + 0.5*2 = 1, G0 = 1 + 0.5 = 1.5; padding rewards (9) are ignored
    torch.testing.assert_close(g, torch.tensor([[1.5, 1.0, 2.0, 0.0], [0.5, 1.0, 0.0, 0.0]]))


def test_discounted_returns_hole_is_not_a_time_step():
    r = torch.tensor([[1.0, 5.0, 2.0]])
    m = torch.tensor([[1.0, 0.0, 1.0]])
    # the masked middle token neither adds its reward nor discounts: G0 = 1 + 0.5 * 2
    torch.testing.assert_close(discounted_returns(r, m, 0.5), torch.tensor([[2.0, 0.0, 2.0]]))


@pytest.mark.parametrize("gamma", [0.0, 0.9, 1.0])
def test_discounted_returns_short_random(gamma):
    gen = torch.Generator().manual_seed(2)
    r = torch.randn(6, 150, generator=gen)
    m = holey_mask(gen, 6, 150)
    ref = serial_returns(r, m, gamma)
    torch.testing.assert_close(discounted_returns(r, m, gamma).double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gamma", [0.99, 1.0])
def test_discounted_returns_long_matches_float64_serial(gamma):
    gen = torch.Generator().manual_seed(3)
    batch, length = 32, 8192
    r = torch.randn(batch, length, generator=gen)
    m = holey_mask(gen, batch, length)
    out = discounted_returns(r, m, gamma)
    assert out.dtype == torch.float32
    ref = serial_returns(r, m, gamma)
    err = (out.double() - ref).abs().max().item()
    assert err <= 1e-5 * ref.abs().max().item(), err


@pytest.mark.parametrize("gamma,lambd", [(1.0, 0.95), (0.99, 0.95), (0.9, 1.0), (1.0, 0.0)])
def test_gae_short_random(gamma, lambd):
    gen = torch.Generator().manual_seed(4)
    r = torch.randn(5, 130, generator=gen)
    v = torch.randn(5, 130, generator=gen)
    m = holey_mask(gen, 5, 130)
    adv, ret = gae_advantages(r, v, m, gamma, lambd)
    ref_adv, ref_ret = serial_gae(r, v, m, gamma, lambd)
    torch.testing.assert_close(adv.double(), ref_adv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret.double(), ref_ret, atol=1e-5, rtol=1e-5)


def test_gae_hand_example():
    # one sample, 3 valid tokens then padding; gamma = lambda = 1 -> A_t = sum_{s>=t} r_s - V_t
    r = torch.tensor([[0.0, 0.0, 1.0, 4.0]])
    v = torch.tensor([[0.5, 0.25, 0.75, 3.0]])
    m = torch.tensor([[1.0, 1, 1, 0]])
    adv, ret = gae_advantages(r, v, m, 1.0, 1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.75, 0.25, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    # lambda = 0: A_t = delta_t = r_t + V_{t+1} - V_t, V after the last valid token = 0 (not the padding's 3.0)
    adv0, _ = gae_advantages(r, v, m, 1.0, 0.0)
    torch.testing.assert_close(adv0, torch.tensor([[-0.25, 0.5, 0.25, 0.0]]))


def test_gae_long_matches_float64_serial():
    gen = torch.Generator().manual_seed(5)
    batch, length = 32, 8192
    r = torch.randn(batch, length, generator=gen) * 0.1
    v = torch.randn(batch, length, generator=gen)
    m = holey_mask(gen, batch, length)
    adv, ret = gae_advantages(r, v, m, 0.999, 0.98)
    ref_adv, ref_ret = serial_gae(r, v, m, 0.999, 0.98)
    assert (adv.double() - ref_adv).abs().max().item() <= 1e-5 * ref_adv.abs().max().item()
    assert (ret.double() - ref_ret).abs().max().item() <= 1e-5 * ref_ret.abs().max().item()


def test_scans_ignore_nan_padding_and_keep_float64():
    r = torch.tensor([[1.0, float("nan")]], dtype=torch.float64)
    v = torch.tensor([[0.0, float("nan")]], dtype=torch.float64)
    m = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    g = discounted_returns(r, m, 0.9)
    assert g.dtype == torch.float64 and torch.equal(g, torch.tensor([[1.0, 0.0]], dtype=torch.float64))
    adv, ret = gae_advantages(r, v, m, 0.9, 0.9)
    assert torch.equal(adv, g) and torch.equal(ret, g)


# ---------------------------------------------------------------------------------------------------------------
# REINFORCE++ and whitening


def test_reinforce_plus_plus_token_rewards():
    kl = torch.tensor([[0.1, 0.2, 0.3, 0.4], [1.0, 1.0, 1.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    mask = right_padded_mask([3, 1, 0], 4)
    out = reinforce_plus_plus_token_rewards(torch.tensor([1.0, -2.0, 7.0]), kl, mask, kl_coef=0.5)
    expected = torch.tensor(
        [
            [-0.05, -0.1, -0.15 + 1.0, 0.0],
            [-0.5 - 2.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0],  # no valid token: the reward has nowhere to go
        ]
    )
    torch.testing.assert_close(out, expected)
    # with gamma = 1 the return at the first token is reward - kl_coef * sum kl
    g = discounted_returns(out, mask, 1.0)
    torch.testing.assert_close(g[:, 0], torch.tensor([1.0 - 0.5 * 0.6, -2.5, 0.0]))


def test_whiten_matches_reference():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(4, 9, generator=gen) * 3 + 2
    mask = holey_mask(gen, 4, 9)
    x[mask == 0] = float("nan")
    out = whiten(x, mask)
    sel = x[mask != 0].double()
    ref = (sel - sel.mean()) / torch.sqrt(sel.var(unbiased=True) + 1e-8)  # slime: Bessel-corrected variance
    torch.testing.assert_close(out[mask != 0].double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.all(out[mask == 0] == 0)
    assert math.isclose(out[mask != 0].double().std(unbiased=True).item(), 1.0, rel_tol=1e-4)
    assert torch.equal(whiten(torch.ones(2, 3), torch.zeros(2, 3)), torch.zeros(2, 3))
