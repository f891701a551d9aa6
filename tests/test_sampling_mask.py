"""Sampling-mask replay (issue 30 item 4): with top-p / top-k the engine returns each position's kept token set and
the log-prob over it; the trainer's log-probs (full-logits and chunked paths, values, entropy and gradients) are
those of the renormalized distribution; a run's train/rollout log-prob mismatch shows the effect."""

import pytest
import torch
from helpers.runs import base_args, run

import lichen.train.micro_batches as micro_mod
from lichen.engines.core.engine import Engine, GenRequest
from lichen.engines.core.sampler import kept_sets
from lichen.models.tiny import make_tiny_model
from lichen.train.actor import TrainActor
from lichen.train.chunked_logprobs import LMHead, chunked_token_log_probs, log_probs_from_logits
from lichen.train.micro_batches import StepBatch
from lichen.train.sampling_mask import KeepSets
from lichen.types import Sample

N, H, V = 40, 8, 50  # 40 positions: chunks of 16 cross the masked / unmasked rows


def _problem(temperature: float, top_p: float, top_k: int, seed: int = 0):
    """float64 hidden, LM head, tokens and the kept sets the engine's sampler gives for these logits: positions
    5..34 truncated (the others keep the full vocabulary), each token drawn from its kept set."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64) * 2
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    bias = torch.randn(V, generator=g, dtype=torch.float64) * 0.5
    logp = torch.log_softmax((hidden @ weight.T + bias) / temperature, -1).float()
    rows = list(range(5, 35))
    tokens = torch.randint(0, V, (N,), generator=g)
    sets, _ = kept_sets(logp[rows], torch.full((30,), top_p), torch.full((30,), top_k), tokens[rows])
    for r, kept in zip(rows, sets):
        tokens[r] = kept[int(torch.randint(0, len(kept), (1,), generator=g))]
    # one "sample" of N positions (flat positions = the sample's response positions)
    per_position: list[list[int] | None] = [None] * N
    for r, kept in zip(rows, sets):
        per_position[r] = kept
    return hidden, weight, bias, tokens, per_position


def _keep_of(per_position) -> KeepSets:
    """KeepSets of N one-position samples (None: that position keeps the full vocabulary)."""
    keep = KeepSets.of([None if k is None else [k] for k in per_position], [1] * N, 1, list(range(N)))
    assert keep is not None
    return keep


def _naive(hidden, weight, bias, tokens, per_position, temperature):
    """float64 log p(token) and H of softmax(z) renormalized over each kept set, straight from the definitions."""
    z = (hidden @ weight.T + bias) / temperature
    keep = torch.ones(N, V, dtype=torch.bool)
    for r, kept in enumerate(per_position):
        if kept is not None:
            keep[r] = False
            keep[r, kept] = True
    logp_all = torch.log_softmax(z.masked_fill(~keep, float("-inf")), -1)
    p = logp_all.exp()
    entropy = -(p * logp_all.masked_fill(~keep, 0.0)).sum(-1)
    return logp_all.gather(-1, tokens[:, None]).squeeze(-1), entropy


@pytest.mark.parametrize("top_p,top_k", [(0.9, -1), (1.0, 5), (0.9, 7)])
@pytest.mark.parametrize("path", ["chunked", "full"])
def test_masked_log_probs_and_gradients_equal_float64_reference(top_p, top_k, path):
    temperature = 0.7
    hidden, weight, bias, tokens, per_position = _problem(temperature, top_p, top_k)
    assert any(k is not None and len(k) < V for k in per_position)  # the sets truncate
    if top_k > 0:
        assert all(k is None or len(k) <= top_k for k in per_position)
    g = torch.Generator().manual_seed(1)
    g_lp, g_ent = torch.randn(N, generator=g, dtype=torch.float64), torch.randn(N, generator=g, dtype=torch.float64)
    results = []
    for mine in (True, False):
        h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
        if not mine:
            logp, ent = _naive(h, w, b, tokens, per_position, temperature)
        elif path == "chunked":
            logp, ent = chunked_token_log_probs(
                h,
                LMHead(w, b),
                tokens,
                temperature=temperature,
                need_entropy=True,
                chunk_size=16,
                keep=_keep_of(per_position),
            )
        else:
            logits = (h @ w.T + b)[:, None, :]  # [N samples, 1 position, V]
            logp, ent = log_probs_from_logits(
                logits, tokens[:, None], temperature=temperature, need_entropy=True, keep=_keep_of(per_position)
            )
            logp, ent = logp.reshape(N), ent.reshape(N)
        ((g_lp * logp).sum() + (g_ent * ent).sum()).backward()
        results.append([logp.detach(), ent.detach(), h.grad, w.grad, b.grad])
    for got, want in zip(*results):
        assert torch.isfinite(got).all()
        assert (got - want).abs().max().item() <= 1e-10 * max(1.0, want.abs().max().item())
    # the mask matters: the unmasked log-probs of the truncated positions differ
    full = torch.log_softmax((hidden @ weight.T + bias) / temperature, -1).gather(-1, tokens[:, None]).squeeze(-1)
    assert (results[1][0] - full).abs().max().item() > 1e-3


def test_keep_sets_reject_hostile_records():
    with pytest.raises(ValueError, match="sample 7 of the step: rollout_sampling_mask must hold one list"):
        KeepSets.of([[[1, 2]]], [2], 2, [7])  # one set for two response tokens
    with pytest.raises(ValueError, match="rollout_sampling_mask must hold"):
        KeepSets.of([[[-1]]], [1], 1, [0])
    keep = KeepSets.of([[[3, 99]]], [1], 1, [0])
    assert keep is not None
    with pytest.raises(ValueError, match="token id 99 >= the model's vocabulary"):
        keep.dense(0, 1, 50, torch.tensor([3]))


def test_step_batch_carries_the_sets_into_micro_batches():
    a = Sample(tokens=[1, 2, 3, 4], response_length=2, rollout_sampling_mask=[[3, 5], [4]])
    b = Sample(tokens=[1, 2, 3], response_length=1)
    mb = StepBatch([a, b], pad_id=0).micro([[1], [0]], "cpu")
    assert mb.indices == [1, 0] and mb.keep is not None
    dense = mb.keep.dense(0, 4, 8, mb.resp_tokens.reshape(-1))
    assert dense[0].all() and dense[1].all()  # sample b: full vocabulary (and its padding position)
    assert dense[2].nonzero().squeeze(-1).tolist() == [3, 5] and dense[3].nonzero().squeeze(-1).tolist() == [4]
    assert StepBatch([b], pad_id=0).micro([[0]], "cpu").keep is None


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tiny"))
    make_tiny_model(out, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, seed=0, init_std=0.2)
    return Engine.from_pretrained(out)


@pytest.mark.parametrize("top_p,top_k", [(0.9, -1), (1.0, 4)])
def test_engine_returns_kept_sets_and_log_probs_over_them(engine, top_p, top_k):
    """Same tokens with and without the mask (the race is the same); with it, each position's set holds the
    token, and its log-prob is the full one minus log(kept mass), i.e. float64 log_softmax over the set."""
    temperature = 0.7
    req = dict(input_ids=[1, 5, 9], max_new_tokens=12, temperature=temperature, top_p=top_p, top_k=top_k, seed=3)
    plain, masked = engine.generate([GenRequest(**req), GenRequest(**req, return_sampling_mask=True)])
    assert plain.sampling_mask is None and masked.output_ids == plain.output_ids
    assert masked.sampling_mask is not None and len(masked.sampling_mask) == len(masked.output_ids)
    ids = torch.tensor([req["input_ids"] + masked.output_ids])
    with torch.no_grad():
        logits = engine.model.logits(engine.model(ids, torch.arange(ids.shape[1])[None]))[0].double() / temperature
    truncated = 0
    for k, (tok, kept) in enumerate(zip(masked.output_ids, masked.sampling_mask)):
        assert kept == sorted(kept) and tok in kept
        if top_k > 0:
            assert len(kept) == top_k
        truncated += len(kept) < logits.shape[-1]
        z = logits[len(req["input_ids"]) - 1 + k]
        want = torch.log_softmax(z[kept], -1)[kept.index(tok)].item()
        assert masked.output_logprobs[k] == pytest.approx(want, abs=2e-5)
        assert masked.output_logprobs[k] >= plain.output_logprobs[k] - 1e-6
    assert truncated > 0
    greedy = engine.generate([GenRequest(**{**req, "temperature": 0.0}, return_sampling_mask=True)])[0]
    assert greedy.sampling_mask is None  # nothing was sampled from a truncated set


@pytest.mark.parametrize("sampling", [["--rollout-top-p", "0.9"], ["--rollout-top-k", "5"]])
def test_run_mismatch_metric_shows_the_mask(tiny_ckpt, addition_data, tmp_path, monkeypatch, sampling):
    """A top-p 0.9 (top-k 5) run: with the replayed mask the trainer's log-probs equal the rollout's; a trainer that
    ignores the mask (KeepSets never built) scores the full distribution and the metric shows the gap."""
    argv = ["--num-rollout", "2", "--micro-batch-size", "4", "--rollout-temperature", "0.7", "--use-kl-loss", *sampling]
    ref_gap: list[float] = []  # first step: the reference model (= the weights that generated) vs the engine
    phase = TrainActor._log_probs_phase

    def spy(self, tb, plans):
        out = phase(self, tb, plans)
        if not ref_gap:
            ref_gap.append(((tb.ref_log_probs - tb.rollout_log_probs).abs() * tb.mask).max().item())
        return out

    monkeypatch.setattr(TrainActor, "_log_probs_phase", spy)
    rows = run(base_args(tiny_ckpt, addition_data, tmp_path / "with", *argv))
    with_mask = max(m["train/train_rollout_logprob_abs_diff"] for m in rows)
    assert with_mask <= 1e-5 and ref_gap[0] <= 1e-4
    monkeypatch.setattr(micro_mod.KeepSets, "of", classmethod(lambda cls, *a: None))
    ref_gap.clear()
    rows = run(base_args(tiny_ckpt, addition_data, tmp_path / "without", *argv))
    without = min(m["train/train_rollout_logprob_abs_diff"] for m in rows)
    print(f"{sampling}: train_rollout_logprob_abs_diff with the mask {with_mask:.2e}, without {without:.2e}")
    assert without > 1e-3 and ref_gap[0] > 1e-2


@pytest.mark.slow
def test_lichen_serve_returns_the_sets_in_slimes_form(tiny_ckpt, tmp_path):
    """A real `lichen serve`: slime's request (custom_params.return_top_p_token_ids) gets meta_info
    top_p_token_ids / top_p_token_offsets, which the client turns into the per-token sets; the same request
    without it gets none and the same tokens; a malformed answer is one clear error."""
    from helpers.serve_process import call, launch

    from lichen.engines.clients.client import EngineError, generate_payload, result_from_output

    proc = launch(tiny_ckpt, "--num-threads", "1", log_path=str(tmp_path / "serve.log"))
    try:
        req = GenRequest(input_ids=[5, 6, 7], max_new_tokens=6, temperature=0.8, top_p=0.9, seed=11)
        body = generate_payload(GenRequest(**{**req.__dict__, "return_sampling_mask": True}))
        assert body["sampling_params"]["custom_params"] == {"return_top_p_token_ids": True}
        st, out = call(proc.url + "/generate", body)
        assert st == 200, out
        meta = out["meta_info"]
        offsets = meta["top_p_token_offsets"]
        assert len(offsets) == len(out["output_ids"]) + 1 and offsets[-1] == len(meta["top_p_token_ids"])
        res = result_from_output(out, proc.url)
        assert res.sampling_mask is not None and all(t in k for t, k in zip(res.output_ids, res.sampling_mask))
        st, plain = call(proc.url + "/generate", generate_payload(req))
        assert st == 200 and "top_p_token_ids" not in plain["meta_info"]
        assert plain["output_ids"] == out["output_ids"] and result_from_output(plain).sampling_mask is None
        st, bad = call(
            proc.url + "/generate",
            {
                **body,
                "sampling_params": {**body["sampling_params"], "custom_params": {"return_top_p_token_ids": "yes"}},
            },
        )
        assert st == 400 and "return_top_p_token_ids" in str(bad)
    finally:
        proc.stop()
    meta["top_p_token_offsets"] = offsets[:-1]
    with pytest.raises(EngineError, match="top_p_token_offsets must be"):
        result_from_output(out, "http://x")


def test_partial_rollout_continuation_appends_the_sets():
    """A resumed sample's sets are its segments' sets in order; a segment without sets drops them all (the trainer
    then scores the whole response over the full vocabulary rather than misalign positions)."""
    from lichen.engines.core.engine import GenResult
    from lichen.rollout.partial import SEGMENTS_KEY, extend_sample

    s = Sample(
        tokens=[1, 2, 3, 4], response_length=2, rollout_log_probs=[-0.1, -0.2], rollout_sampling_mask=[[3], [4, 5]]
    )
    s.weight_versions, s.metadata[SEGMENTS_KEY] = ["0"], [2]
    res = GenResult([6, 7], [-0.3, -0.4], "stop", 4, "0", sampling_mask=[[6], [1, 7]])
    out = extend_sample(s, res, lambda ids: "", mask_offpolicy=False)
    assert out.rollout_sampling_mask == [[3], [4, 5], [6], [1, 7]] and out.response_length == 4
    res.sampling_mask = None
    assert extend_sample(s, res, lambda ids: "", mask_offpolicy=False).rollout_sampling_mask is None
