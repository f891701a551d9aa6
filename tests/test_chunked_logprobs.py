"""Chunked log-probs (lichen.train.chunked_logprobs, --log-probs-chunk-size): the same values and gradients as the
full-logits computation, without ever holding [tokens, vocabulary] logits.

- the autograd function against a float64 reference written from the formulas (values and gradients w.r.t. the
  hidden states, the LM-head weight and bias; temperature != 1; soft-capping; the entropy's gradient), and against
  the fp32 materialized computation within 1e-6 (relative to the values' scale);
- no tensor of [tokens, vocabulary] is saved for the backward, and no chunk's logits exceed the chunk;
- a train step (every policy loss, SFT, every KL estimator, TIS, OPSM, entropy, packed rows, several optimizer
  steps) gives the same gradients and metrics with the chunked and the full computation;
- the HF wrapper's soft-capped head (gemma-2), and FSDP2 on 2 gloo ranks against the full computation on one.
"""

from __future__ import annotations

import pytest
import torch
from helpers.dist_ranks import (
    assert_matches_single_rank,
    config,
    free_port,
    grads_worker,
    rank_files,
    rel_diff,
    run_ranks,
    step_batch,
    trainer_argv,
)
from helpers.trainer import make_actor, ragged_samples, recorded_grads

import lichen.train.advantage as advantage_mod
import lichen.train.chunked_logprobs as chunked_mod
from lichen.train.actor import TrainActor
from lichen.train.chunked_logprobs import (
    LMHead,
    chunk_bounds,
    chunked_token_log_probs,
    materialized_token_log_probs,
)


def naive_float64(hidden, weight, bias, softcap, tokens, temperature):
    """log p(token) and H straight from the definitions, in float64."""
    logits = hidden.double() @ weight.double().T
    if bias is not None:
        logits = logits + bias.double()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    z = logits / temperature
    p = torch.exp(z - z.max(-1, keepdim=True).values)
    p = p / p.sum(-1, keepdim=True)
    logp_all = torch.log(p)
    return logp_all.gather(-1, tokens[:, None]).squeeze(-1), -(p * logp_all).sum(-1)


def _inputs(n, h, v, dtype, *, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.3
    b = torch.randn(v, generator=g, dtype=torch.float64) * 0.5 if bias else None
    tokens = torch.randint(0, v, (n,), generator=g)
    g_lp, g_ent = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    leaf = lambda t: None if t is None else t.to(dtype).clone().requires_grad_()  # noqa: E731
    return leaf(hidden), leaf(weight), leaf(b), tokens, g_lp.to(dtype), g_ent.to(dtype)


def _run(fn, n, h, v, dtype, *, bias, softcap, temperature, entropy, **kw):
    """(log-probs, entropy, grad hidden, grad weight, grad bias) of loss = sum(g_lp * logp) + sum(g_ent * H)."""
    hidden, weight, b, tokens, g_lp, g_ent = _inputs(n, h, v, dtype, bias=bias)
    if fn is naive_float64:
        logp, ent = naive_float64(hidden, weight, b, softcap, tokens, temperature)
    else:
        logp, ent = fn(hidden, LMHead(weight, b, softcap), tokens, temperature=temperature, need_entropy=entropy, **kw)
    loss = (g_lp * logp).sum() + ((g_ent * ent).sum() if entropy else 0.0)
    loss.backward()
    out = [logp.detach(), ent.detach() if entropy else None, hidden.grad, weight.grad, b.grad if bias else None]
    return [None if t is None else t.double() for t in out]


def _close(mine, ref, rel):
    """Every pair within rel x max(1, the reference's largest magnitude)."""
    for i, (a, b) in enumerate(zip(mine, ref)):
        if a is None or b is None:
            assert a is None and b is None, i
            continue
        scale = max(1.0, b.abs().max().item())
        err = (a - b).abs().max().item()
        assert err <= rel * scale, (i, err, scale)


CASES = [  # (temperature, softcap, bias, entropy)
    (1.0, None, False, False),
    (0.7, None, False, True),
    (1.3, 30.0, True, True),
    (0.6, 5.0, False, True),  # the soft-cap bites: |l| reaches past c
]


@pytest.mark.parametrize("temperature,softcap,bias,entropy", CASES)
@pytest.mark.parametrize("chunk", [16, 20, 1000])
def test_float64_chunks_equal_the_formulas(temperature, softcap, bias, entropy, chunk):
    """In float64 the chunked forward and its hand-written backward are the definitions up to float64 rounding."""
    kw = dict(bias=bias, softcap=softcap, temperature=temperature, entropy=entropy)
    ref = _run(naive_float64, 53, 12, 300, torch.float64, **kw)
    mine = _run(chunked_token_log_probs, 53, 12, 300, torch.float64, chunk_size=chunk, **kw)
    _close(mine, ref, 1e-12)


@pytest.mark.parametrize("temperature,softcap,bias,entropy", CASES)
def test_float32_chunks_equal_the_materialized_computation(temperature, softcap, bias, entropy):
    """fp32: chunked vs the full-logits computation within 1e-6 (of the values' scale), both near float64."""
    kw = dict(bias=bias, softcap=softcap, temperature=temperature, entropy=entropy)
    full = _run(materialized_token_log_probs, 77, 16, 1000, torch.float32, **kw)
    mine = _run(chunked_token_log_probs, 77, 16, 1000, torch.float32, chunk_size=16, **kw)
    _close(mine, full, 1e-6)
    ref = _run(naive_float64, 77, 16, 1000, torch.float64, **kw)
    _close(mine, ref, 2e-6)
    _close(full, ref, 2e-6)


def test_qwen3_vocabulary_against_float64():
    """At 151,936 entries the fp32 chunked result is as close to float64 as the materialized one (measured: both
    within ~5e-6 of the values' scale). 13-position chunks of 40 leave a 1-row tail, which MIN_CHUNK_ROWS joins to
    the chunk before it: alone, its [1, V] @ [V, H] product put the hidden states' gradient 2.5e-5 off."""
    kw = dict(bias=False, softcap=None, temperature=0.7, entropy=True)
    ref = _run(naive_float64, 40, 32, 151_936, torch.float64, **kw)
    mine = _run(chunked_token_log_probs, 40, 32, 151_936, torch.float32, chunk_size=13, **kw)
    full = _run(materialized_token_log_probs, 40, 32, 151_936, torch.float32, **kw)
    _close(mine, ref, 1e-5)
    _close(full, ref, 1e-5)


def test_chunk_bounds_cover_every_position_once():
    assert chunk_bounds(0, 16) == []
    assert chunk_bounds(5, 16) == [(0, 5)]
    assert chunk_bounds(40, 16) == [(0, 16), (16, 40)]  # an 8-row tail joins the chunk before it
    assert chunk_bounds(100, 32) == [(0, 32), (32, 64), (64, 100)]
    assert chunk_bounds(64, 3) == [(0, 16), (16, 32), (32, 48), (48, 64)]  # at least MIN_CHUNK_ROWS


def test_no_vocabulary_sized_tensor_is_saved_or_computed(monkeypatch):
    """The autograd graph saves nothing of [N, V] (the materialized graph does), and each logits matmul covers
    one chunk of positions only."""
    n, h, v, chunk = 64, 8, 500, 16
    rows = []
    linear = chunked_mod.F.linear
    monkeypatch.setattr(chunked_mod.F, "linear", lambda x, *a: rows.append(x.shape[0]) or linear(x, *a))

    def saved_sizes(fn, **kw):
        sizes = []
        hidden, weight, _, tokens, _, _ = _inputs(n, h, v, torch.float32, bias=False)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            logp, ent = fn(hidden, LMHead(weight), tokens, temperature=0.7, need_entropy=True, **kw)
        (logp.sum() + ent.sum()).backward()
        return sizes

    chunked = saved_sizes(chunked_token_log_probs, chunk_size=chunk)
    assert max(chunked) == v * h  # the weight itself; nothing of n * v
    assert rows and max(rows) <= chunk and sum(rows) == 2 * n  # the forward's chunks, the backward's recompute
    assert max(saved_sizes(materialized_token_log_probs)) >= n * v  # the reference does hold them


def test_bf16_autocast_runs_the_head_in_bfloat16():
    """Under --bf16's autocast the chunked head computes in bfloat16 as the materialized one does: same values
    to bf16 rounding, float32 outputs, float32 gradients for float32 leaves."""
    kw = dict(bias=False, softcap=None, temperature=0.7, entropy=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mine = _run(chunked_token_log_probs, 40, 16, 500, torch.float32, chunk_size=16, **kw)
        full = _run(materialized_token_log_probs, 40, 16, 500, torch.float32, **kw)
    _close(mine, full, 2e-2)


# ---- the trainer ----------------------------------------------------------------------------------------------
TRAINER_CASES = {
    "ppo_clip": [],
    "entropy_temperature": ["--entropy-coef", "0.01", "--rollout-temperature", "0.7"],
    "gspo": ["--advantage-estimator", "gspo", "--entropy-coef", "0.02"],
    "cispo": ["--advantage-estimator", "cispo"],
    "sft": ["--loss-type", "sft_loss"],
    "kl_k1": ["--use-kl-loss", "--kl-loss-coef", "0.1", "--kl-loss-type", "k1"],
    "kl_k2": ["--use-kl-loss", "--kl-loss-coef", "0.1", "--kl-loss-type", "k2"],
    "kl_k3_unbiased_two_steps": [
        *["--use-kl-loss", "--kl-loss-coef", "0.1", "--kl-loss-type", "k3", "--use-unbiased-kl"],
        *["--num-steps-per-rollout", "2", "--rollout-temperature", "1.3"],
    ],
    "low_var_kl_kl_in_reward": [
        *["--advantage-estimator", "reinforce_plus_plus", "--normalize-advantages", "--kl-coef", "0.05"],
        *["--use-kl-loss", "--kl-loss-type", "low_var_kl"],
    ],
    "tis_opsm": ["--use-tis", "--use-opsm", "--force-recompute-old-log-probs"],
    "packed_rows": ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "40", "--entropy-coef", "0.01"],
}


@pytest.mark.parametrize("name", list(TRAINER_CASES))
def test_train_step_matches_the_full_logits(tiny_ckpt, addition_data, tmp_path, monkeypatch, name):
    extra = TRAINER_CASES[name]
    adv = torch.tensor([0.5, -1.0, 0.3, 2.0, -0.2, 0.1, 0.0, 0.4, 1.5, -0.25, 0.6, 0.75])
    monkeypatch.setattr(
        advantage_mod, "compute_advantages", lambda cfg, samples, mask, kl=None, **plugin: (adv[:, None] * mask, {})
    )
    samples = None
    results = []
    for chunk in ("-1", "16"):
        actor = make_actor(tiny_ckpt, addition_data, tmp_path, "--log-probs-chunk-size", chunk, *extra)
        if chunk != "-1":  # the chunked trainer never computes full logits
            monkeypatch.setattr(actor.model, "logits", lambda h: pytest.fail("full logits computed"))
        samples = samples or ragged_samples(actor.model.cfg.vocab_size, seed=2)
        with recorded_grads(actor.model, actor.optimizer) as seen:
            metrics = actor.train(0, [samples])
        grads = seen[0]
        results.append((metrics, grads, actor.last_token_values["trainer_log_probs"]))
    (m_full, g_full, lp_full), (m_chunk, g_chunk, lp_chunk) = results
    scale = max(1.0, max(g.abs().max().item() for g in g_full.values()))
    assert scale > 1e-3
    for n in g_full:
        assert (g_chunk[n] - g_full[n]).abs().max().item() <= 1e-6 * scale, n
    for key, value in m_full.items():
        if not key.startswith("time/"):
            assert m_chunk[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key
    if lp_full is not None:
        assert (lp_chunk - lp_full).abs().max().item() <= 1e-5


def test_chunked_is_the_default(tiny_ckpt, addition_data, tmp_path):
    actor = make_actor(tiny_ckpt, addition_data, tmp_path)
    assert actor.cfg.batching.log_probs_chunk_size == 512 and actor.log_probs.chunk_size == 512


def test_hf_softcapped_head_matches_its_logits():
    """The HF wrapper's LM head with gemma-2 soft-capping: LMHead.of reads weight and cap, and the chunked result
    equals the full computation through the wrapper's own `logits`."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from lichen.models.hf_model import HFCausalLM
    from lichen.train.chunked_logprobs import log_probs_from_logits

    torch.manual_seed(0)
    cfg = Gemma2Config(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=2.0,
    )
    model = HFCausalLM(Gemma2ForCausalLM(cfg))
    head = LMHead.of(model)
    assert head.softcap == 2.0 and head.weight is model.lm_head_weight
    hidden = (torch.randn(40, 32) * 3).requires_grad_()
    tokens = torch.randint(0, 300, (40,))
    full = log_probs_from_logits(model.logits(hidden), tokens, temperature=0.8, need_entropy=True)
    mine = chunked_token_log_probs(hidden, head, tokens, temperature=0.8, need_entropy=True, chunk_size=16)
    g_full = torch.autograd.grad(full[0].sum() + full[1].sum(), [hidden, head.weight])
    g_mine = torch.autograd.grad(mine[0].sum() + mine[1].sum(), [hidden, head.weight])
    _close([t.detach().double() for t in (*mine, *g_mine)], [t.detach().double() for t in (*full, *g_full)], 1e-6)


def _local_run(argv):
    """The single-rank trainer's 3 steps on the dist tests' batches: (actor, metrics, first-step gradients)."""
    cfg, args = config(argv)
    local = TrainActor(cfg, plugin_args=args)
    vocab = local.model.cfg.vocab_size
    with recorded_grads(local.model, local.optimizer) as seen:
        metrics = [local.train(0, step_batch(vocab, 0))]
    grads = seen[0]
    metrics += [local.train(k, step_batch(vocab, k)) for k in range(1, 3)]
    return local, metrics, grads


@pytest.mark.slow
def test_two_fsdp_ranks_chunked_match_one_rank(tiny_ckpt, addition_data, tmp_path):
    """FSDP2 (the root keeps the gathered LM head after forward, its gradient reduced after the whole backward):
    2 gloo ranks with 16-position chunks and the entropy and KL terms match the single-rank chunked trainer as
    the dist tests require (gradients, losses, weights after 3 steps), and the single-rank full-logits trainer in
    first-step gradients (1e-6 relative) and every step's loss. (Weights after 3 AdamW steps at lr 1e-3 are not
    compared with the full-logits run: Adam's normalisation turns 1e-7 gradient differences on near-zero entries
    into 7e-5 weight differences, measured; the same happens between the 1- and 2-rank full-logits runs.)"""
    common = ["--entropy-coef", "0.01", "--rollout-temperature", "0.8", "--use-kl-loss", "--kl-loss-coef", "0.1"]
    out = str(tmp_path / "o")
    chunked = trainer_argv(tiny_ckpt, addition_data, out, *common, "--log-probs-chunk-size", "16")
    run_ranks(grads_worker, 2, chunked, free_port(), str(tmp_path), 3)
    ranks = rank_files(tmp_path, 2)
    assert_matches_single_rank(ranks, *_local_run(chunked))
    _, metrics, grads = _local_run(trainer_argv(tiny_ckpt, addition_data, out, *common, "--log-probs-chunk-size", "-1"))
    worst = max(rel_diff(ranks[0]["grads"][n], g) for n, g in grads.items())
    assert worst <= 1e-6, worst
    for mine, ref in zip(ranks[0]["metrics"], metrics):
        assert abs(mine["train/loss"] - ref["train/loss"]) <= 1e-5


def test_engine_prompt_log_probs_in_chunks_equal_one_pass(tiny_ckpt, monkeypatch):
    """The in-process engine scores a prompt PROMPT_LOGPROB_CHUNK positions at a time: 5-position chunks (a
    40-token prompt, scored from position 3) give the one-pass values, top log-probs and picked ids exactly."""
    from lichen.engines.core import decode_batch
    from lichen.engines.core.decode_batch import DecodeBatch, Seq
    from lichen.engines.core.engine import Engine

    engine = Engine.from_pretrained(tiny_ckpt, dtype=torch.float32)
    prompt = [(7 * i) % 90 + 3 for i in range(40)]

    rows: list[int] = []
    logits = engine.model.logits
    monkeypatch.setattr(engine.model, "logits", lambda h: rows.append(h.shape[0]) or logits(h))

    def scored(chunk: int) -> Seq:
        monkeypatch.setattr(decode_batch, "PROMPT_LOGPROB_CHUNK", chunk)
        rows.clear()
        seq = Seq(
            input_ids=list(prompt),
            max_new_tokens=0,
            input_logprob_start=3,
            temperature=0.7,
            top_logprobs_num=3,
            token_ids_logprob=[5, 9],
        )
        DecodeBatch(engine.model).add([seq], "0")
        return seq

    one = scored(10**6)
    assert max(rows) == 40 - 4
    chunked = scored(5)
    assert max(rows) == 5  # never more than a chunk of positions' logits
    assert len(chunked.input_logprobs) == 40 - 3 and chunked.input_logprobs[0] is None
    # fp32: a chunk's logits matmul rounds like the whole prompt's only up to ~1e-7 (the BLAS kernel depends on
    # the row count)
    assert chunked.input_logprobs[1:] == pytest.approx(one.input_logprobs[1:], rel=0, abs=1e-6)
    for mine, ref in ((chunked.input_top, one.input_top), (chunked.input_ids_lp, one.input_ids_lp)):
        assert mine[0] is None and ref[0] is None and len(mine) == len(ref)
        for row, ref_row in zip(mine[1:], ref[1:]):
            assert [i for _, i in row] == [i for _, i in ref_row]
            assert [v for v, _ in row] == pytest.approx([v for v, _ in ref_row], rel=0, abs=1e-6)
