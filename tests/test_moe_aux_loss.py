"""--moe-aux-loss-coeff (lichen.train.router_aux): the router's load-balancing loss in the training loss, on the
generic HF path (docs/models.md#moe).

The term is checked against an independent reference: every sample run alone, the router logits recomputed from
each router's weights and its input, and a loop over tokens counting the top-k assignments and summing the router
probabilities per expert.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.runs import base_args
from helpers.trainer import make_actor, ragged_samples, recorded_grads

from lichen.cli import main
from lichen.models.loading import load_model
from lichen.models.tiny import make_tiny_model
from lichen.train.log_probs import LogProbs
from lichen.train.micro_batches import StepBatch
from lichen.train.router_aux import RouterAuxLoss

MOE = ["qwen3_moe", "gpt_oss"]
SMALL = dict(
    hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48, max_position_embeddings=256
)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("aux_archs")
    return {arch: make_tiny_model(str(root / arch), arch=arch, **SMALL) for arch in [*MOE, "llama"]}


def _routers(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def _reference_aux(model, inputs: list[list[int]]) -> torch.Tensor:
    """E * sum_e f_e * P_e over every token of `inputs` (each sample's input tokens, run alone) and every MoE layer,
    by a loop over tokens. Differentiable in the router weights."""
    routers = _routers(model)
    assert routers, "no MoE router found"
    seen: list[tuple[torch.nn.Module, torch.Tensor]] = []
    hooks = [r.register_forward_hook(lambda mod, args, out: seen.append((mod, args[0]))) for r in routers]
    E, k = model.hf.num_experts, model.hf.num_experts_per_tok
    counts, prob_sums, n = [0] * E, [], 0
    try:
        for toks in inputs:
            seen.clear()
            ids = torch.tensor([toks])
            model(ids, torch.arange(len(toks))[None])
            assert len(seen) == len(routers)
            for router, h in seen:
                logits = F.linear(h.reshape(-1, h.shape[-1]), router.weight, getattr(router, "bias", None))
                for t in range(len(toks)):
                    p = torch.softmax(logits[t].float(), dim=-1)
                    for e in sorted(range(E), key=lambda e: -float(p[e].detach()))[:k]:
                        counts[e] += 1
                    prob_sums.append(p)
                    n += 1
    finally:
        for hook in hooks:
            hook.remove()
    prob = torch.stack(prob_sums).sum(0)
    return E * sum((counts[e] / n) * (prob[e] / n) for e in range(E))


@pytest.mark.parametrize("arch", MOE)
def test_term_equals_a_naive_reference_per_micro_batch(ckpts, arch):
    """Packed rows with padding and one-sample rows: each micro-batch's share is aux(its tokens) x its share of
    the step's tokens, aux as the reference computes it with each sample alone (padding never counts)."""
    model = load_model(ckpts[arch], impl="hf")
    samples = ragged_samples(model.cfg.vocab_size, n=6, seed=3)
    batch = StepBatch(samples, pad_id=0)
    inputs = [s.tokens[:-1] for s in samples]
    lengths = batch.input_lengths
    lp = LogProbs(torch.device("cpu"), 1.0, False)
    aux = RouterAuxLoss(model, 0.5)
    assert aux.active
    # packed rows (padding after the shorter row), a single row, one sample per row (plain right padding)
    plans = [[[0, 1], [2]], [[3]], [[4], [5]]]
    total = sum(lengths)
    got = []
    for plan in plans:
        with aux.recording(model):
            lp.forward(model, batch.micro(plan, "cpu"))
        got.append(float(aux.share(model, plan, lengths, plans, torch.device("cpu")).detach()))
    for plan, share in zip(plans, got):
        rows = [i for row in plan for i in row]
        want = float(_reference_aux(model, [inputs[i] for i in rows]).detach()) * sum(lengths[i] for i in rows) / total
        print(f"{arch} {plan}: share {share:.9g}, reference {want:.9g}")
        assert share == pytest.approx(want, rel=1e-6)
    # one micro-batch holding the whole step: the module's own aux over every token
    whole = [[[0, 1], [2, 3], [4, 5]]]
    with aux.recording(model):
        lp.forward(model, batch.micro(whole[0], "cpu"))
    assert float(aux.share(model, whole[0], lengths, whole, torch.device("cpu")).detach()) == pytest.approx(
        float(_reference_aux(model, inputs).detach()), rel=1e-6
    )


def test_no_grad_forwards_record_nothing(ckpts):
    model = load_model(ckpts["qwen3_moe"], impl="hf")
    aux = RouterAuxLoss(model, 0.5)
    with aux.recording(model), torch.no_grad():
        model(torch.tensor([[5, 6, 7]]), torch.arange(3)[None])
    assert aux.share(model, [[0]], [3], [[[0]]], torch.device("cpu")) is None


@pytest.mark.parametrize("arch", MOE)
def test_router_gradient_is_coeff_times_the_references(ckpts, addition_data, tmp_path, arch):
    """Equal rewards (every advantage 0): the policy loss gives no gradient, so with coeff 0 every gradient is
    zero; with coeff c the router weights get c x d(aux)/dW of the reference, the final norm (after every router)
    none, and the step logs loss = c x train/moe_aux_loss."""
    coeff = 0.5
    grads = {}
    for c in (0.0, coeff):
        actor = make_actor(
            ckpts[arch],
            addition_data,
            tmp_path / str(c),
            "--model-impl",
            "hf",
            "--moe-aux-loss-coeff",
            str(c),
            "--micro-batch-size",
            "12",
        )
        samples = ragged_samples(actor.model.cfg.vocab_size)
        reference = _reference_aux(actor.model, [s.tokens[:-1] for s in samples])
        routers = _routers(actor.model)
        want = torch.autograd.grad(coeff * reference, [r.weight for r in routers])
        with recorded_grads(actor.model, actor.optimizer) as seen:
            metrics = actor.train(0, [samples[i : i + 4] for i in range(0, 12, 4)])
        grads[c] = seen[0]
        name = {p: n for n, p in actor.model.named_parameters()}
        if c == 0:
            assert "train/moe_aux_loss" not in metrics
            assert all(not g.any() for g in grads[c].values())
            continue
        assert metrics["train/moe_aux_loss"] == pytest.approx(float(reference.detach()), rel=1e-6)
        assert metrics["train/loss"] == pytest.approx(coeff * metrics["train/moe_aux_loss"], rel=1e-6)
        assert metrics["train/skipped_samples"] == 0  # no zero-loss sample to skip with the term on
        for r, w in zip(routers, want):
            assert torch.allclose(grads[c][name[r.weight]], w, rtol=1e-5, atol=1e-9)
            assert grads[c][name[r.weight]].abs().max() > 0
        assert not grads[c][name[actor.model.base.norm.weight]].any()


def test_coeff_zero_keeps_the_old_path(ckpts, addition_data, tmp_path, monkeypatch):
    """--moe-aux-loss-coeff 0 (the default) on a MoE model: no router logits requested, the zero-advantage skip
    still on, no aux metric."""
    actor = make_actor(ckpts["qwen3_moe"], addition_data, tmp_path, "--model-impl", "hf")
    base = actor.model.base
    calls: list[dict] = []
    real = base.forward

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(base, "forward", spy)
    samples = ragged_samples(actor.model.cfg.vocab_size)
    for s in samples:
        s.reward = 0.5 if s.group_index == 0 else float(s.index % 4)  # only group 0 has zero advantages
    metrics = actor.train(0, [samples[i : i + 4] for i in range(0, 12, 4)])
    assert calls and not any(c.get("output_router_logits") for c in calls)
    assert metrics["train/skipped_samples"] == 4 and "train/moe_aux_loss" not in metrics


def test_dense_model_warns_and_trains_bit_identically(ckpts, addition_data, tmp_path, caplog):
    """A dense model has no router loss: coeff > 0 is logged as ignored (Megatron ignores it for a dense model)
    and the step is the coeff-0 step, bit for bit."""
    weights = []
    for c in ("0", "0.3"):
        with caplog.at_level("WARNING", logger="lichen.train.router_aux"):
            actor = make_actor(
                ckpts["llama"], addition_data, tmp_path / c, "--model-impl", "hf", "--moe-aux-loss-coeff", c
            )
        samples = ragged_samples(actor.model.cfg.vocab_size)
        for s in samples:
            s.reward = float(s.index % 3)
        metrics = actor.train(0, [samples[i : i + 4] for i in range(0, 12, 4)])
        assert "train/moe_aux_loss" not in metrics
        weights.append({n: p.detach().clone() for n, p in actor.model.named_parameters()})
    warned = [r.getMessage() for r in caplog.records if r.name == "lichen.train.router_aux"]
    assert len(warned) == 1 and "--moe-aux-loss-coeff 0.3 is ignored" in warned[0] and "llama" in warned[0]
    assert all(torch.equal(weights[0][n], w) for n, w in weights[1].items())


def test_negative_coefficient_exits_2_naming_the_flag(tiny_ckpt, addition_data, tmp_path, capsys):
    assert (
        main(
            base_args(
                tiny_ckpt, addition_data, tmp_path, "--dry-run", "--num-rollout", "1", "--moe-aux-loss-coeff", "-0.1"
            )
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "--moe-aux-loss-coeff" in err and "Traceback" not in err
