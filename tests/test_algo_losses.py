"""lichen.algo.losses and lichen.algo.kl against hand-checked values and naive float64 references."""

from __future__ import annotations

import math

import pytest
import torch

from lichen.algo.kl import approx_kl
from lichen.algo.losses import (
    cispo_policy_loss,
    entropy_from_logits,
    gspo_policy_loss,
    opsm_mask,
    ppo_policy_loss,
    sft_loss,
    value_loss,
)
from lichen.algo.reduce import aggregate_loss


def ref_ppo_token(ratio, adv, lo, hi, c):
    """One token of the PPO loss and its derivative w.r.t. log_prob, by case analysis (float64 Python)."""
    pg1, pg2 = -adv * ratio, -adv * min(max(ratio, lo), hi)
    if pg1 >= pg2:
        loss, grad, clipped = pg1, -adv * ratio, 0.0
    else:
        loss, grad, clipped = pg2, 0.0, 1.0
    if c is not None and adv < 0 and -c * adv < loss:
        loss, grad = -c * adv, 0.0
    return loss, grad, clipped


# ---------------------------------------------------------------------------------------------------------------
# PPO


def test_ppo_hand_example():
    ratio = torch.tensor([2.0, 2.0, 0.5])
    out = ppo_policy_loss(ratio.log(), torch.zeros(3), torch.tensor([2.0, -2.0, 2.0]), eps_clip=0.2, eps_clip_c=1.5)
    # [max(-4, -2.4), min(max(4, 2.4), 3.0), max(-1, -1.6)]
    torch.testing.assert_close(out["loss"], torch.tensor([-2.4, 3.0, -1.0]))
    torch.testing.assert_close(out["clipfrac"], torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(out["ratio"], ratio)
    torch.testing.assert_close(out["ppo_kl"], -ratio.log())


@pytest.mark.parametrize("eps_high,c", [(None, None), (0.28, None), (0.28, 3.0)])
def test_ppo_matches_reference_values_and_grads(eps_high, c):
    gen = torch.Generator().manual_seed(0)
    lp = (torch.randn(8, 16, generator=gen, dtype=torch.float64) * 0.5).requires_grad_()
    old = torch.randn(8, 16, generator=gen, dtype=torch.float64) * 0.5
    adv = torch.randn(8, 16, generator=gen, dtype=torch.float64) * 2
    out = ppo_policy_loss(lp, old, adv, eps_clip=0.2, eps_clip_high=eps_high, eps_clip_c=c)
    out["loss"].sum().backward()
    hi = 1 + (0.2 if eps_high is None else eps_high)
    ref = [
        ref_ppo_token(math.exp(a - b), x, 0.8, hi, c)
        for a, b, x in zip(lp.detach().flatten().tolist(), old.flatten().tolist(), adv.flatten().tolist())
    ]
    ref_loss, ref_grad, ref_clip = (torch.tensor(col, dtype=torch.float64).view(8, 16) for col in zip(*ref))
    torch.testing.assert_close(out["loss"].detach(), ref_loss)
    torch.testing.assert_close(lp.grad, ref_grad)
    torch.testing.assert_close(out["clipfrac"], ref_clip)
    assert 0 < ref_clip.mean() < 1  # both branches exercised
    for key in ("clipfrac", "ppo_kl", "ratio"):
        assert not out[key].requires_grad


def test_ppo_rejects_bad_dual_clip_and_survives_extreme_ratios():
    with pytest.raises(ValueError, match="eps-clip-c"):
        ppo_policy_loss(torch.zeros(2), torch.zeros(2), torch.ones(2), eps_clip=0.2, eps_clip_c=1.0)
    lp = torch.tensor([100.0, -100.0, 100.0]).requires_grad_()
    out = ppo_policy_loss(lp, torch.zeros(3), torch.tensor([1.0, -1.0, -1.0]), eps_clip=0.2, eps_clip_c=3.0)
    out["loss"].sum().backward()
    assert torch.isfinite(out["loss"]).all() and torch.isfinite(lp.grad).all()
    torch.testing.assert_close(out["loss"], torch.tensor([-1.2, 0.8, 3.0]))


# ---------------------------------------------------------------------------------------------------------------
# GSPO


def test_gspo_ratio_is_sequence_level_with_per_token_gradient():
    gen = torch.Generator().manual_seed(1)
    lp = (torch.randn(4, 6, generator=gen, dtype=torch.float64) * 0.1).requires_grad_()
    old = torch.randn(4, 6, generator=gen, dtype=torch.float64) * 0.1
    mask = torch.tensor([[1.0] * 6, [1.0] * 3 + [0.0] * 3, [1, 0, 1, 1, 0, 1], [0.0] * 6], dtype=torch.float64)
    old[1, 3:] = 50.0  # padding garbage must not enter the sequence ratio
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0], dtype=torch.float64)[:, None].expand(4, 6)
    out = gspo_policy_loss(lp, old, adv, mask, eps_clip=1.0, eps_clip_high=1.0)  # wide range: nothing clipped
    seq = [
        sum((lp[b, t] - old[b, t]).item() for t in range(6) if mask[b, t]) / max(mask[b].sum().item(), 1)
        for b in range(4)
    ]
    expected_ratio = torch.tensor([[math.exp(s)] * 6 for s in seq], dtype=torch.float64)
    torch.testing.assert_close(out["ratio"], expected_ratio)
    (out["loss"] * mask).sum().backward()
    torch.testing.assert_close(lp.grad, -adv * expected_ratio * mask)


def test_gspo_token_form_has_the_sequence_objective_gradient():
    """Averaged over a sample's tokens, GSPO-token's gradient equals that of the sequence objective
    max(-A s, -A clip(s)) with s = exp(mean log ratio) differentiated end to end (clipped samples included)."""
    gen = torch.Generator().manual_seed(2)
    lp0 = torch.randn(6, 10, generator=gen, dtype=torch.float64) * 0.3
    old = torch.randn(6, 10, generator=gen, dtype=torch.float64) * 0.3
    mask = (torch.rand(6, 10, generator=gen) > 0.2).double()
    adv_seq = torch.tensor([1.0, -1.0, 2.0, -0.5, 1.0, -2.0], dtype=torch.float64)
    adv = adv_seq[:, None].expand(6, 10)

    lp = lp0.clone().requires_grad_()
    out = gspo_policy_loss(lp, old, adv, mask, eps_clip=0.1, eps_clip_high=0.15)
    aggregate_loss(out["loss"], mask, "seq-mean-token-mean", global_num_samples=6, global_num_tokens=1).backward()

    lp_ref = lp0.clone().requires_grad_()
    s = torch.exp(((lp_ref - old) * mask).sum(-1) / mask.sum(-1))
    ref = torch.maximum(-adv_seq * s, -adv_seq * s.clamp(0.9, 1.15)).sum() / 6
    ref.backward()
    assert out["clipfrac"].amax(-1).sum() >= 1 and out["clipfrac"].amax(-1).sum() < 6
    torch.testing.assert_close(lp.grad, lp_ref.grad)
    torch.testing.assert_close(
        aggregate_loss(out["loss"].detach(), mask, "seq-mean-token-mean", global_num_samples=6, global_num_tokens=1),
        ref.detach(),
    )


# ---------------------------------------------------------------------------------------------------------------
# CISPO, OPSM


def test_cispo_values_and_stop_gradient():
    ratio = torch.tensor([2.0, 0.5, 1.1], dtype=torch.float64)
    old = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    lp = (old + ratio.log()).requires_grad_()
    adv = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    out = cispo_policy_loss(lp, old, adv, eps_clip=0.2, eps_clip_high=0.5)
    weight = torch.tensor([1.5, 0.8, 1.1], dtype=torch.float64)
    torch.testing.assert_close(out["loss"], -weight * adv * lp.detach())
    out["loss"].sum().backward()
    torch.testing.assert_close(lp.grad, -weight * adv)  # the weight is a constant: no d(ratio)/d(log_prob) term
    torch.testing.assert_close(out["clipfrac"], torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64))


def test_opsm_mask():
    lp = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, -1.0, -1.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    old = torch.tensor([[0.0, 0.0, 9.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1], [1, 1, 1], [0, 0, 0]])
    adv = torch.tensor([-1.0, 1.0, -1.0, -1.0])
    # seq KL: [1.0 (padding's 9 ignored), 1.0, 1/3, 0 (empty)]; delta 0.5 -> only sample 0 (negative A) is dropped
    out = opsm_mask(lp, old, adv, mask, delta=0.5)
    assert torch.equal(out, torch.tensor([[0.0] * 3, [1.0] * 3, [1.0] * 3, [1.0] * 3]))


# ---------------------------------------------------------------------------------------------------------------
# entropy, value, SFT


def test_entropy_matches_naive_and_handles_banned_tokens():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, 11, generator=gen) * 4
    p = torch.softmax(logits.double(), -1)
    torch.testing.assert_close(entropy_from_logits(logits).double(), -(p * p.log()).sum(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy_from_logits(torch.zeros(2, 7)), torch.full((2,), math.log(7)))
    big = torch.tensor([[1000.0, 1000.0, -1000.0]])  # naive softmax overflows here
    torch.testing.assert_close(entropy_from_logits(big), torch.tensor([math.log(2)]))
    banned = torch.tensor([[0.0, 0.0, float("-inf"), 0.0]], requires_grad=True)
    ent = entropy_from_logits(banned)
    ent.sum().backward()
    torch.testing.assert_close(ent.detach(), torch.tensor([math.log(3)]))
    assert torch.isfinite(banned.grad).all()
    assert entropy_from_logits(logits.bfloat16()).dtype == torch.float32


def test_value_loss():
    v = torch.tensor([1.5, 1.0, 0.3, 7.0])
    old = torch.tensor([1.0, 0.0, 0.3, 0.0])
    ret = torch.tensor([0.0, 1.0, 0.0, 0.0])
    # token 0: max(2.25, (1.2 - 0)^2) = 2.25; token 1: max(0, (0.2 - 1)^2) = 0.64; token 2: 0.09
    torch.testing.assert_close(value_loss(v, old, ret, value_clip=0.2)[:3], torch.tensor([2.25, 0.64, 0.09]))
    torch.testing.assert_close(value_loss(v, old, ret), (v - ret) ** 2)  # no 0.5 factor, as slime
    masked = value_loss(v, old, ret, torch.tensor([1.0, 1.0, 1.0, 0.0]), value_clip=0.2)
    assert masked[3] == 0
    vv = v.clone().requires_grad_()
    value_loss(vv, old, ret, value_clip=0.2).sum().backward()
    # token 1 is taken from the clipped branch where v is outside the clip range: no gradient
    torch.testing.assert_close(vv.grad[:3], torch.tensor([3.0, 0.0, 0.6]))


def test_sft_loss():
    lp = torch.tensor([[-0.5, -2.0]], requires_grad=True)
    out = sft_loss(lp)
    torch.testing.assert_close(out, torch.tensor([[0.5, 2.0]]))
    out.sum().backward()
    torch.testing.assert_close(lp.grad, -torch.ones(1, 2))


# ---------------------------------------------------------------------------------------------------------------
# KL estimators


def test_kl_estimators_match_formulas():
    lp = torch.tensor([-1.0, -0.2, -3.0, -0.7], dtype=torch.float64)
    ref = torch.tensor([-1.5, -0.2, 0.0, -5.0], dtype=torch.float64)
    x = (lp - ref).tolist()
    torch.testing.assert_close(approx_kl(lp, ref, "k1"), torch.tensor(x, dtype=torch.float64))
    torch.testing.assert_close(approx_kl(lp, ref, "kl"), torch.tensor(x, dtype=torch.float64))
    torch.testing.assert_close(approx_kl(lp, ref, "k2"), torch.tensor([v * v / 2 for v in x], dtype=torch.float64))
    k3 = [math.exp(-v) - 1 + v for v in x]
    torch.testing.assert_close(approx_kl(lp, ref, "k3"), torch.tensor(k3, dtype=torch.float64))
    torch.testing.assert_close(
        approx_kl(lp, ref, "low_var_kl"), torch.tensor([min(max(v, -10), 10) for v in k3], dtype=torch.float64)
    )
    assert k3[2] > 10  # the clamp was exercised
    with pytest.raises(ValueError, match="kl-loss-type"):
        approx_kl(lp, ref, "k4")


def test_kl_estimators_are_unbiased_where_claimed():
    # tokens sampled from pi; E_pi[k1] = E_pi[k3] = KL(pi || ref) exactly when summed over the support
    pi = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    ref = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    true_kl = (pi * (pi / ref).log()).sum()
    for kind in ("k1", "k3"):
        torch.testing.assert_close((pi * approx_kl(pi.log(), ref.log(), kind)).sum(), true_kl)


def test_low_var_kl_extreme_is_finite_with_finite_grad():
    lp = torch.tensor([-200.0, 200.0, 0.0], requires_grad=True)
    out = approx_kl(lp, torch.zeros(3), "low_var_kl")
    out.sum().backward()
    torch.testing.assert_close(out.detach(), torch.tensor([10.0, 10.0, 0.0]))
    assert torch.isfinite(lp.grad).all()


def test_unbiased_kl_importance_weight_is_detached():
    lp = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -1.0], dtype=torch.float64)
    old = torch.tensor([-1.2, -2.5], dtype=torch.float64)
    ilr = lp - old  # carries a graph: approx_kl must cut it
    out = approx_kl(lp, ref, "k2", importance_log_ratio=ilr)
    w = torch.exp(lp.detach() - old)
    torch.testing.assert_close(out, w * (lp.detach() - ref) ** 2 / 2)
    out.sum().backward()
    torch.testing.assert_close(lp.grad, w * (lp.detach() - ref))  # no d(w)/d(log_prob) term
