"""The trainer's fast paths compute the same update as the plain computation (issue: Performance vs TRL).

- packed micro-batches (several samples per row, block-diagonal causal mask) give each sample the log-probs it
  gets alone, checked in float64 against one unpadded forward per sample;
- the gradient of a step (sorted + packed + zero-advantage skip) equals a float64 reference computed sample by
  sample from the loss formula, for every loss aggregation mode;
- skipping zero-advantage samples leaves gradients bit-for-bit unchanged (and metrics unchanged);
- the fused AdamW equals a hand-written float64 AdamW.
"""

import copy
import random

import pytest
import torch
from helpers.trainer import grads_of_step, make_actor, ragged_samples

import lichen.train.advantage as advantage_mod
from lichen.models import load_model
from lichen.train.actor import TrainActor
from lichen.train.micro_batches import StepBatch, first_fit, plan_micro_batches
from lichen.train.optim import adamw_implementation, make_adamw
from lichen.types import Status


# ---- helpers ------------------------------------------------------------------------------------------------
def fixed_advantages(monkeypatch, values: list[float]) -> torch.Tensor:
    """Replace the estimator: sample i gets advantage values[i] on every response token."""
    adv = torch.tensor(values, dtype=torch.float32)
    monkeypatch.setattr(
        advantage_mod, "compute_advantages", lambda cfg, samples, mask, kl=None, **plugin: (adv[:, None] * mask, {})
    )
    return adv


def reference_grads(actor: TrainActor, samples, adv: torch.Tensor, mode: str, max_len: int) -> dict:
    """float64, one unpadded forward per sample, straight from the formulas: at the first step ratio = 1, so the
    PPO-clip loss of token t has gradient -A * d log pi(y_t); per-sample terms are reduced by `mode` with counts
    over the whole batch."""
    model = copy.deepcopy(actor.model).double()
    model.zero_grad(set_to_none=True)
    num_samples = len(samples)
    num_tokens = sum(s.response_length for s in samples)
    total = 0.0
    for s, a in zip(samples, adv.tolist()):
        ids = torch.tensor(s.tokens[:-1])[None]
        hidden = model(ids, torch.arange(ids.shape[1])[None])
        p = s.prompt_length
        logp = torch.log_softmax(model.logits(hidden[0, p - 1 :]), dim=-1)
        lp = logp.gather(-1, torch.tensor(s.tokens[p:])[:, None]).squeeze(-1)
        per_tok = -a * lp
        if mode == "seq-mean-token-mean":
            total = total + per_tok.mean() / num_samples
        elif mode == "token-mean":
            total = total + per_tok.sum() / num_tokens
        else:  # seq-mean-token-sum-norm
            total = total + per_tok.sum() / max_len / num_samples
    total.backward()
    return {n: p.grad for n, p in model.named_parameters()}


def max_abs(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


# ---- layout -------------------------------------------------------------------------------------------------
def test_first_fit_and_micro_batch_plans_respect_the_budget():
    rng = random.Random(3)
    lengths = [rng.randint(1, 60) for _ in range(80)]
    bins = first_fit(list(range(80)), lengths, 60)
    assert sorted(i for b in bins for i in b) == list(range(80))
    assert all(sum(lengths[i] for i in b) <= 60 for b in bins)
    assert len(bins) <= sum(lengths) / 60 * 1.25 + 1  # first-fit-decreasing wastes little on this mix
    # ragged lengths as in RL rollouts: mostly short, a long tail
    lengths = [min(1 + int(rng.expovariate(1 / 12)), 80) for _ in range(80)]
    computed = {}
    for sort in (True, False):
        for pack in (True, False):
            plans = plan_micro_batches(
                list(range(80)), lengths, micro_batch_size=4, max_tokens=400, sort=sort, pack=pack
            )
            assert sorted(i for p in plans for row in p for i in row) == list(range(80))
            size = 0
            for p in plans:
                width = max(sum(lengths[i] for i in row) for row in p)
                assert len(p) * width <= 400 or sum(map(len, p)) == 1
                size += len(p) * width
            computed[sort, pack] = size
            fixed = plan_micro_batches(
                list(range(80)), lengths, micro_batch_size=7, max_tokens=None, sort=sort, pack=pack
            )
            assert [sum(map(len, p)) for p in fixed] == [7] * 11 + [3]
    useful = sum(lengths)
    assert computed[True, True] <= 1.05 * useful < 1.3 * useful < computed[True, False] < computed[False, False]
    assert computed[False, True] <= 1.05 * useful


def test_packed_rows_give_each_sample_its_own_log_probs(tiny_ckpt):
    model = load_model(tiny_ckpt, device="cpu", dtype=torch.float64).eval()
    samples = ragged_samples(model.cfg.vocab_size, n=9)
    sb = StepBatch(samples, pad_id=0)
    plan = [[4, 0], [7, 2, 8], [1]]
    mb = sb.micro(plan, "cpu")
    assert mb.indices == [4, 0, 7, 2, 8, 1] and mb.input_ids.shape[0] == 3 and mb.attn_mask is not None
    with torch.no_grad():
        hidden = mb.response_hidden(model(mb.input_ids, mb.position_ids, attn_mask=mb.attn_mask))
        for j, i in enumerate(mb.indices):
            s = samples[i]
            alone = model(torch.tensor(s.tokens[:-1])[None], torch.arange(len(s.tokens) - 1)[None])[0]
            expect = alone[s.prompt_length - 1 :]
            assert torch.allclose(hidden[j, : s.response_length], expect, atol=1e-10, rtol=0)
            assert mb.resp_tokens[j, : s.response_length].tolist() == s.tokens[s.prompt_length :]
            assert mb.resp_mask[j].sum().item() == s.response_length


# ---- gradients ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
def test_step_gradient_matches_float64_reference(tiny_ckpt, addition_data, tmp_path, monkeypatch, mode):
    actor = make_actor(
        tiny_ckpt,
        addition_data,
        tmp_path,
        "--use-dynamic-batch-size",
        "--max-tokens-per-gpu",
        "40",
        "--loss-agg-mode",
        mode,
    )
    samples = ragged_samples(actor.model.cfg.vocab_size)
    adv = fixed_advantages(monkeypatch, [0.5, -1.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0, 1.5, -0.25, 0.0, 0.75])
    ref = reference_grads(actor, samples, adv, mode, max_len=14)
    fast, metrics = grads_of_step(actor, samples)
    assert metrics["train/skipped_samples"] == 6  # zero advantage: no backward
    scale = max(g.abs().max().item() for g in ref.values())
    assert max_abs(fast, ref) <= 1e-5 * scale
    # and the plain computation (sample order, one padded row per sample, no skip) agrees with it
    plain, _ = grads_of_step(actor, samples, sort_by_length=False, pack_sequences=False, skip_zero_advantage=False)
    assert max_abs(fast, plain) <= 1e-6


def test_sorted_packed_equals_unsorted_padded_for_fixed_micro_batches(tiny_ckpt, addition_data, tmp_path, monkeypatch):
    actor = make_actor(tiny_ckpt, addition_data, tmp_path, "--micro-batch-size", "6")
    samples = ragged_samples(actor.model.cfg.vocab_size, seed=1)
    fixed_advantages(monkeypatch, [0.3 * (i - 5) for i in range(12)])
    fast, m_fast = grads_of_step(actor, samples)
    plain, m_plain = grads_of_step(actor, samples, sort_by_length=False, pack_sequences=False)
    assert max_abs(fast, plain) <= 1e-6
    assert max(g.abs().max().item() for g in plain.values()) > 1e-3  # the gradient is not trivially zero
    for key in ("train/loss", "train/ppo_kl", "train/train_rollout_logprob_abs_diff"):
        assert m_fast[key] == pytest.approx(m_plain[key], abs=1e-6)


@pytest.mark.parametrize("extra", [[], ["--force-recompute-old-log-probs"], ["--use-tis"]])
def test_zero_advantage_skip_is_bit_identical(tiny_ckpt, addition_data, tmp_path, monkeypatch, extra):
    """Micro-batches of one sample: skipping removes exactly-zero gradient terms, so the sum is bit-identical."""
    actor = make_actor(tiny_ckpt, addition_data, tmp_path, "--micro-batch-size", "1", *extra)
    samples = ragged_samples(actor.model.cfg.vocab_size, seed=2)
    samples[5].status = Status.FAILED  # masked out entirely: skipped as well
    fixed_advantages(monkeypatch, [0.0, 1.0, 0.0, -1.0, 0.0, 0.5, 0.0, 0.0, 2.0, 0.0, -0.5, 0.0])
    skip, m_skip = grads_of_step(actor, samples)
    full, m_full = grads_of_step(actor, samples, skip_zero_advantage=False)
    assert m_skip["train/skipped_samples"] == 8 and m_full["train/skipped_samples"] == 0
    assert all(torch.equal(skip[k], full[k]) for k in full)
    for key in m_full:
        if key.startswith("train/") and key != "train/skipped_samples":
            assert m_skip[key] == pytest.approx(m_full[key], abs=1e-6), key


def test_skip_keeps_optimizer_state_when_no_sample_has_signal(tiny_ckpt, addition_data, tmp_path, monkeypatch):
    actor = make_actor(tiny_ckpt, addition_data, tmp_path, "--micro-batch-size", "4")
    samples = ragged_samples(actor.model.cfg.vocab_size, seed=4)
    fixed_advantages(monkeypatch, [0.0] * 12)
    a, b = copy.deepcopy(actor), copy.deepcopy(actor)
    b.skip_zero_advantage = False
    ma, mb = a.train(0, [samples]), b.train(0, [samples])
    assert ma["train/skipped_samples"] == 12 and ma["train/grad_norm"] == 0.0 == mb["train/grad_norm"]
    # AdamW saw zero gradients in both (its step count and moments advance alike)
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys() and len(sa) == len(list(actor.model.parameters()))
    for k in sa:
        assert all(torch.equal(sa[k][f], sb[k][f]) for f in ("step", "exp_avg", "exp_avg_sq"))
    assert ma["train/train_rollout_logprob_abs_diff"] == pytest.approx(
        mb["train/train_rollout_logprob_abs_diff"], abs=1e-7
    )


def test_skip_is_off_when_another_term_reads_the_sample(tiny_ckpt, addition_data, tmp_path, monkeypatch):
    actor = make_actor(tiny_ckpt, addition_data, tmp_path, "--micro-batch-size", "4", "--entropy-coef", "0.01")
    samples = ragged_samples(actor.model.cfg.vocab_size, seed=5)
    fixed_advantages(monkeypatch, [0.0] * 6 + [1.0] * 6)
    _, metrics = grads_of_step(actor, samples)
    assert metrics["train/skipped_samples"] == 0


# ---- optimizer ----------------------------------------------------------------------------------------------
def adamw_float64(params, grads_per_step, lr, betas, eps, wd):
    """Decoupled weight decay Adam, written out: p -= lr*wd*p; p -= lr * m_hat / (sqrt(v_hat) + eps)."""
    p = [x.double().clone() for x in params]
    m = [torch.zeros_like(x) for x in p]
    v = [torch.zeros_like(x) for x in p]
    for t, grads in enumerate(grads_per_step, start=1):
        for i, g in enumerate(grads):
            g = g.double()
            m[i] = betas[0] * m[i] + (1 - betas[0]) * g
            v[i] = betas[1] * v[i] + (1 - betas[1]) * g * g
            p[i] = p[i] * (1 - lr * (wd if p[i].dim() >= 2 else 0.0))  # 1-D params do not decay (Megatron's rule)
            p[i] = p[i] - lr * (m[i] / (1 - betas[0] ** t)) / ((v[i] / (1 - betas[1] ** t)).sqrt() + eps)
    return p


@pytest.mark.parametrize("impl", ["fused", "foreach", "single"])
def test_adamw_implementations_match_float64_reference(impl):
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(17, 9, generator=gen), torch.randn(33, generator=gen)]
    steps = [[torch.randn(x.shape, generator=gen) for x in init] for _ in range(6)]
    params = [torch.nn.Parameter(x.clone()) for x in init]
    opt = make_adamw(params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, implementation=impl)
    assert bool(opt.defaults.get("fused")) == (impl == "fused")
    assert bool(opt.defaults.get("foreach")) == (impl == "foreach")
    for grads in steps:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    ref = adamw_float64(init, steps, 1e-2, (0.9, 0.999), 1e-8, 0.1)
    for p, r in zip(params, ref):
        assert (p.detach().double() - r).abs().max().item() <= 1e-6
    assert max((p.detach() - x).abs().max().item() for p, x in zip(params, init)) > 1e-2  # it did move


def test_trainer_uses_fused_adamw_on_cpu(tiny_ckpt, addition_data, tmp_path):
    assert adamw_implementation([torch.zeros(2)]) == "fused"
    assert adamw_implementation([torch.zeros(2, dtype=torch.long)]) == "foreach"
    actor = make_actor(tiny_ckpt, addition_data, tmp_path)
    assert actor.optimizer.defaults["fused"] is True
    with pytest.raises(ValueError, match="unknown AdamW implementation"):
        make_adamw(
            [torch.nn.Parameter(torch.zeros(2))],
            lr=1e-3,
            betas=(0.9, 0.999),
            eps=1e-8,
            weight_decay=0.0,
            implementation="turbo",
        )
