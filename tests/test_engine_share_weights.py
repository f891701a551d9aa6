"""The in-process engine serves the trainer's tensors themselves (Engine.share_weights, used by sync.push): what it
generates is what a copy would generate, a later copy never writes into the shared tensors, a misfit falls back
to a copy, tied parameters stay tied, and a push through the real loop's sync shares and verifies."""

from __future__ import annotations

import types

import pytest
import torch

from lichen import sync
from lichen.engines.core.engine import Engine, GenRequest
from lichen.models import load_model
from lichen.models.tiny import make_tiny_model
from lichen.sync.verify import WeightMismatchError, verify_in_process


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("tiny"))
    make_tiny_model(out, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, seed=0, init_std=0.2)
    return out


def greedy(engine: Engine) -> list[int]:
    req = GenRequest(input_ids=[50, 51, 52], max_new_tokens=6, temperature=0, ignore_eos=True)
    return engine.generate([req])[0].output_ids


def trainer_weights(ckpt: str, impl: str = "auto") -> dict[str, torch.Tensor]:
    """What the local trainer's named_weights() yields: its parameters, detached (the same memory)."""
    model = load_model(ckpt, impl=impl)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():  # weights the engine did not load, so sharing is seen in the output
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return {n: p.detach() for n, p in model.named_parameters()}


def test_a_shared_engine_generates_what_a_copy_generates_and_serves_the_tensors_in_place(ckpt):
    weights = trainer_weights(ckpt)
    shared, copied = Engine.from_pretrained(ckpt), Engine.from_pretrained(ckpt)
    assert shared.share_weights(weights.items(), "1") is True
    copied.update_weights_from_tensors(weights.items(), "1")
    params = dict(shared.model.named_parameters())
    assert all(params[n].data_ptr() == t.data_ptr() for n, t in weights.items())
    assert greedy(shared) == greedy(copied) and shared.weight_version == "1"
    assert verify_in_process(shared, weights.items(), 1) == len(weights)

    # the trainer's optimizer steps in place: the shared engine serves that, the copy does not
    with torch.no_grad():
        for t in weights.values():
            t.mul_(-1.0)
    assert greedy(shared) != greedy(copied)
    with pytest.raises(WeightMismatchError):
        verify_in_process(copied, weights.items(), 2)


def test_a_copy_after_sharing_never_writes_into_the_shared_tensors(ckpt):
    weights = trainer_weights(ckpt)
    before = {n: t.clone() for n, t in weights.items()}
    engine = Engine.from_pretrained(ckpt)
    engine.share_weights(weights.items(), "1")
    other = {n: torch.zeros_like(t) for n, t in weights.items()}
    engine.update_weights_from_tensors(other.items(), "2")  # e.g. a disk load, or a misfit below
    assert all(torch.equal(weights[n], before[n]) for n in weights)  # the trainer's tensors are untouched
    assert all(torch.equal(p, torch.zeros_like(p)) for p in engine.model.parameters())


@pytest.mark.parametrize("misfit", ["dtype", "missing", "grad"])
def test_tensors_that_do_not_fit_are_copied(ckpt, misfit):
    weights = trainer_weights(ckpt)
    if misfit == "dtype":
        weights = {n: t.to(torch.float64) for n, t in weights.items()}
    elif misfit == "missing":
        weights.pop(next(iter(weights)))
    else:
        weights = {n: t.clone().requires_grad_(True) for n, t in weights.items()}
    engine = Engine.from_pretrained(ckpt)
    assert engine.share_weights(weights.items(), "1") is False
    params = dict(engine.model.named_parameters())
    assert not any(params[n].data_ptr() == t.data_ptr() for n, t in weights.items())
    assert all(torch.equal(params[n], t.to(params[n].dtype)) for n, t in weights.items())


def test_tied_parameters_stay_tied(ckpt):
    """The generic HF model ties its LM head to the embeddings by holding one Parameter in two modules."""
    weights = trainer_weights(ckpt, impl="hf")
    engine = Engine.from_pretrained(ckpt, model_options={"impl": "hf"})
    tied = [m for m in engine.model.modules() if any(p is not None for p in m._parameters.values())]
    holders = [(m, k) for m in tied for k, p in m._parameters.items() if p is not None]
    assert len(holders) > len(dict(engine.model.named_parameters()))  # this model does tie a parameter
    copied = Engine.from_pretrained(ckpt, model_options={"impl": "hf"})
    copied.update_weights_from_tensors(weights.items(), "1")
    assert engine.share_weights(weights.items(), "1") is True
    ptrs = {m._parameters[k].data_ptr() for m, k in holders}
    assert ptrs == {t.data_ptr() for t in weights.values()}  # both holders of the tied one serve its tensor
    assert greedy(engine) == greedy(copied)


def test_push_shares_with_the_in_process_engine_and_verifies(ckpt):
    model = load_model(ckpt)
    trainer = types.SimpleNamespace(named_weights=lambda: ((n, p.detach()) for n, p in model.named_parameters()))
    engine = Engine.from_pretrained(ckpt)
    rollout = types.SimpleNamespace(engines=[engine])
    out = sync.push(trainer, rollout, version=1)
    assert out["sync/shared_weights"] == 1 and engine.weight_version == "1"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.tensor([[50, 51, 52, 53]])
    model.logits(model(ids, torch.arange(4)[None])).sum().backward()
    before = greedy(engine)
    opt.step()
    out = sync.push(trainer, rollout, version=2)
    assert out["sync/shared_weights"] == 1 and engine.weight_version == "2"
    fresh = Engine.from_pretrained(ckpt)
    fresh.update_weights_from_tensors(((n, p.detach()) for n, p in model.named_parameters()), "2")
    assert greedy(engine) == greedy(fresh) != before
