"""Prompt sharing (lichen.train.micro_batches.PromptGroups): a group's prompt computed once per packed row gives
the unshared layout's log-probs and gradients, checked in float64 against the same step with sharing off."""

import random

import pytest
import torch
from helpers.trainer import grads_of_step, make_actor

import lichen.train.advantage as advantage_mod
from lichen.models import load_model
from lichen.train.log_probs import LogProbs
from lichen.train.micro_batches import PromptGroups, StepBatch, plan_micro_batches
from lichen.train.step_schedule import plan_cost, split_across_ranks
from lichen.types import Sample, Status


def grouped_samples(
    vocab: int, *, prompts: int = 3, per_prompt: int = 4, seed: int = 0, rollout_lp: bool = True
) -> list[Sample]:
    """`prompts` prompts x `per_prompt` samples, plus a sample whose prompt is a strict prefix of prompt 0's (same
    tokens, shorter: it must not share), one with a one-token response and one multi-turn sample whose response
    has loss-masked (tool output) tokens."""
    rng = random.Random(seed)
    out: list[Sample] = []

    def add(prompt: list[int], r: int, loss_mask=None) -> None:
        tokens = prompt + [rng.randrange(5, vocab) for _ in range(r)]
        out.append(
            Sample(
                tokens=tokens,
                response_length=r,
                reward=0.0,
                status=Status.COMPLETED,
                group_index=len(out) // per_prompt,
                index=len(out),
                rollout_log_probs=[-2.0] * r if rollout_lp else None,
                loss_mask=loss_mask,
            )
        )

    heads = [[rng.randrange(5, vocab) for _ in range(rng.randint(4, 8))] for _ in range(prompts)]
    for head in heads:
        for _ in range(per_prompt):
            add(head, rng.randint(2, 9))
    add(heads[0][:-1], 5)  # a prefix of prompt 0: a different prompt
    add(heads[1], 1)  # shares prompt 1; its only token is predicted from the shared prompt's last position
    add(heads[2], 8, loss_mask=[1, 1, 0, 0, 0, 1, 1, 1])  # multi-turn: tool output masked, prompt still shared
    return out


def fixed_advantages(monkeypatch, values: list[float]) -> None:
    adv = torch.tensor(values, dtype=torch.float64)
    monkeypatch.setattr(
        advantage_mod,
        "compute_advantages",
        lambda cfg, samples, mask, kl=None, **plugin: (adv[:, None].to(mask.dtype) * mask, {}),
    )


def test_only_identical_prompts_share_and_widths_count_them_once():
    s = grouped_samples(64)
    g = PromptGroups.of(s)
    assert g.group[:4] == [0] * 4 and g.group[4:8] == [4] * 4 and g.group[12] == 12  # the prefix prompt alone
    assert g.group[13] == 4 and g.group[14] == 8
    lengths = [len(x.tokens) - 1 for x in s]
    row = [0, 1, 2, 12]
    p = s[0].prompt_length
    assert g.row_width(row, lengths) == sum(lengths[i] for i in row) - 2 * p
    assert plan_cost([row, [3]], lengths, g) == 2 * g.row_width(row, lengths)


@pytest.mark.parametrize("max_tokens, mbs", [(None, 5), (60, 1), (400, 1)])
def test_shared_plans_place_every_sample_once_and_cost_less(max_tokens, mbs):
    s = grouped_samples(64, prompts=4, per_prompt=8)
    lengths = [len(x.tokens) - 1 for x in s]
    g = PromptGroups.of(s)
    idx = list(range(len(s)))
    shared = plan_micro_batches(idx, lengths, micro_batch_size=mbs, max_tokens=max_tokens, sharing=g)
    plain = plan_micro_batches(idx, lengths, micro_batch_size=mbs, max_tokens=max_tokens)
    assert sorted(i for plan in shared for row in plan for i in row) == idx
    if max_tokens:
        assert all(plan_cost(plan, lengths, g) <= max_tokens or len(plan) == 1 for plan in shared)
    assert sum(plan_cost(p, lengths, g) for p in shared) < 0.75 * sum(plan_cost(p, lengths) for p in plain)
    # ranks balance the shared layout's real positions, and all get the same number of micro-batches
    shares = split_across_ranks(shared, lengths, 2, g)
    assert len(shares[0]) == len(shares[1])
    loads = [sum(plan_cost(p, lengths, g) for p in share if p is not None) for share in shares]
    assert max(loads) - min(loads) <= max(plan_cost(p, lengths, g) for p in shared)


def test_shared_rows_give_each_sample_its_unshared_log_probs_float64(tiny_ckpt):
    model = load_model(tiny_ckpt, device="cpu", dtype=torch.float64).eval()
    s = grouped_samples(model.cfg.vocab_size)
    lp = LogProbs(torch.device("cpu"), temperature=0.7, bf16=False)
    plan = [[0, 1, 12, 4, 5, 13], [2, 3, 8, 14, 6], [9, 7, 10, 11]]  # prompts mixed, the prefix prompt among them
    shared, plain = StepBatch(s, 0, share_prompts=True), StepBatch(s, 0)
    mb_s, mb_p = shared.micro(plan, "cpu"), plain.micro(plan, "cpu")
    assert mb_s.indices == mb_p.indices
    assert mb_s.input_ids.numel() < mb_p.input_ids.numel()
    with torch.no_grad():
        a, _ = lp.forward(model, mb_s)
        b, _ = lp.forward(model, mb_p)
    assert a.dtype == torch.float64
    assert torch.equal(mb_s.resp_mask, mb_p.resp_mask) and torch.equal(mb_s.resp_tokens, mb_p.resp_tokens)
    assert (a - b).mul(mb_p.resp_mask).abs().max().item() <= 1e-10
    # and each equals the sample alone, unpadded
    for j, i in enumerate(mb_s.indices):
        x = s[i]
        with torch.no_grad():
            h = model(torch.tensor(x.tokens[:-1])[None], torch.arange(len(x.tokens) - 1)[None])[0]
            ref = torch.log_softmax(model.logits(h[x.prompt_length - 1 :]) / 0.7, -1)
        ref = ref.gather(-1, torch.tensor(x.response_tokens)[:, None]).squeeze(-1)
        assert (a[j, : x.response_length] - ref).abs().max().item() <= 1e-10


def _double(actor):
    actor.model.double()
    if actor.critic is not None:
        actor.critic.model.double()
    return actor


def _rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    scale = max(v.abs().max().item() for v in b.values())
    assert scale > 1e-6  # the gradient is not trivially zero
    return max((a[k] - b[k]).abs().max().item() for k in a) / scale


@pytest.mark.parametrize(
    "extra",
    [
        ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "60"],
        ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096", "--disable-zero-advantage-skip"],
        ["--micro-batch-size", "2", "--entropy-coef", "0.01", "--num-steps-per-rollout", "3"],
        ["--micro-batch-size", "3", "--use-lora", "--lora-rank", "4"],
    ],
)
def test_train_step_gradients_equal_the_unshared_layout_float64(tiny_ckpt, addition_data, tmp_path, monkeypatch, extra):
    actor = _double(make_actor(tiny_ckpt, addition_data, tmp_path, *extra))
    assert actor.share_prompts
    s = grouped_samples(actor.model.cfg.vocab_size, rollout_lp=False)  # float64: no fp32 mismatch metric
    fixed_advantages(monkeypatch, [0.5, -1.0, 0.0, 2.0, 1.0, -0.5, 0.0, 0.25, 1.5, -0.25, 0.0, 0.75, -1.0, 0.3, 0.9])
    shared, m_s = grads_of_step(actor, s, share_prompts=True)
    plain, m_p = grads_of_step(actor, s, share_prompts=False)
    assert _rel(shared, plain) <= 1e-9
    if "--num-steps-per-rollout" not in extra:
        assert m_s["train/ppo_kl"] == 0.0 == m_p["train/ppo_kl"]  # first step: the policy is the old one
    assert m_s["train/ppo_kl"] == pytest.approx(m_p["train/ppo_kl"], rel=1e-9, abs=1e-12)
    assert m_s["train/loss"] == pytest.approx(m_p["train/loss"], rel=1e-9, abs=1e-12)


def test_ppo_step_with_critic_on_the_shared_layout(tiny_ckpt, addition_data, tmp_path):
    actor = _double(
        make_actor(
            tiny_ckpt,
            addition_data,
            tmp_path,
            "--advantage-estimator",
            "ppo",
            "--micro-batch-size",
            "4",
            "--num-critic-only-steps",
            "0",
        )
    )
    s = grouped_samples(actor.model.cfg.vocab_size, rollout_lp=False)
    for k, x in enumerate(s):
        x.reward = float(k % 3) - 1.0
    shared, m_s = grads_of_step(actor, s, share_prompts=True)
    plain, m_p = grads_of_step(actor, s, share_prompts=False)
    assert _rel(shared, plain) <= 1e-9
    for key in m_p:
        if key.startswith("critic/"):  # the critic hands fp32 values on (lichen.train.critic): fp32 rounding
            assert m_s[key] == pytest.approx(m_p[key], rel=1e-6, abs=1e-9), key


def test_critic_values_and_gradients_on_the_shared_layout_float64(tiny_ckpt):
    """The critic reads the same micro-batches (values at resp_index); its layout is exact in float64."""
    from lichen.train.critic import ValueModel

    model = ValueModel(load_model(tiny_ckpt, device="cpu", dtype=torch.float64)).double()
    torch.nn.init.normal_(model.value_head.weight, std=0.1)
    s = grouped_samples(model.backbone.cfg.vocab_size)
    plan = [[0, 1, 12, 4, 5, 13], [2, 3, 8, 14, 6], [9, 7, 10, 11]]
    out = []
    for share in (True, False):
        model.zero_grad(set_to_none=True)
        mb = StepBatch(s, 0, share_prompts=share).micro(plan, "cpu")
        hidden = model.backbone(mb.input_ids, mb.position_ids, attn_mask=mb.attn_mask)
        values = model.value_head(mb.response_hidden(hidden)).squeeze(-1) * mb.resp_mask
        (values * torch.linspace(-1, 1, values.shape[1], dtype=torch.float64)).sum().backward()
        out.append((values.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (v_s, g_s), (v_p, g_p) = out
    assert (v_s - v_p).abs().max().item() <= 1e-10
    assert _rel(g_s, g_p) <= 1e-9


def test_sharing_is_off_with_the_flag_and_on_the_hf_model_path(tiny_ckpt, addition_data, tmp_path):
    assert not make_actor(tiny_ckpt, addition_data, tmp_path, "--disable-prompt-sharing").share_prompts
    assert not make_actor(tiny_ckpt, addition_data, tmp_path, "--model-impl", "hf").share_prompts


def test_ranks_are_balanced_by_the_shared_layouts_positions():
    """A micro-batch of 8 samples sharing a 10-token prompt computes 26 positions, not 96: it is the smallest of
    three, so it joins the lighter rank last (counted unshared, it would be dealt first)."""
    prompt = list(range(5, 15))
    s = [Sample(tokens=prompt + [20 + k, 21, 22], response_length=3) for k in range(8)]
    s += [Sample(tokens=list(range(30, 70)), response_length=5), Sample(tokens=list(range(30, 61)), response_length=5)]
    lengths = [len(x.tokens) - 1 for x in s]
    g = PromptGroups.of(s)
    p1, p2, p3 = [list(range(8))], [[8]], [[9]]
    assert [plan_cost(p, lengths, g) for p in (p1, p2, p3)] == [26, 39, 30]
    assert split_across_ranks([p1, p2, p3], lengths, 2, g) == [[p2, None], [p3, p1]]
