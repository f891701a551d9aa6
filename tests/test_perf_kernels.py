"""The model's rewritten RoPE (issue 19) against the formula HF writes, bit for bit.

RoPE multiplies roll(x, D/2) by a sin whose first half is negated, instead of building rotate_half(x) with
chunk + neg + cat. It reorders nothing, so outputs and gradients must equal the reference exactly (torch.equal).
"""

from __future__ import annotations

import torch

from lichen.models.transformer import apply_rope


def reference_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _grads(fn, *inputs):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


def test_rope_is_bit_identical_to_rotate_half():
    torch.manual_seed(2)
    B, H, T, D = 3, 4, 11, 64
    x = torch.randn(B, H, T, D)
    angle = torch.randn(B, 1, T, D // 2) * 5
    emb = torch.cat((angle, angle), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    signed = torch.cat((-sin[..., : D // 2], sin[..., D // 2 :]), dim=-1)
    out, (gx,) = _grads(lambda x_: apply_rope(x_, cos, signed), x)
    ref, (rgx,) = _grads(lambda x_: reference_rope(x_, cos, sin), x)
    assert torch.equal(out, ref)
    assert torch.equal(gx, rgx)


def test_model_rope_returns_the_signed_sin(tmp_path):
    """CausalLM.rope hands apply_rope cat(-sin1, sin2) of the HF angles, so the model's attention is HF's."""
    from lichen.models import load_model
    from lichen.models.tiny import make_tiny_model

    make_tiny_model(str(tmp_path), hidden_size=64, num_layers=1, num_heads=4, intermediate_size=128, seed=0)
    model = load_model(str(tmp_path), device="cpu", dtype=torch.float32)
    pos = torch.arange(7)[None]
    cos, signed = model.rope(pos, torch.float32)
    freqs = pos[..., None].float() * model._inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    half = emb.shape[-1] // 2
    assert torch.equal(cos[:, 0], emb.cos())
    assert torch.equal(signed[:, 0, :, :half], -emb.sin()[..., :half])
    assert torch.equal(signed[:, 0, :, half:], emb.sin()[..., half:])


def test_attention_builds_no_rotate_half(tmp_path):
    """One attention forward runs no neg and no cat on q / k: rotate_half's chunk + neg + cat are gone."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lichen.models import load_model
    from lichen.models.tiny import make_tiny_model

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    make_tiny_model(str(tmp_path), hidden_size=64, num_layers=1, num_heads=4, intermediate_size=128, seed=0)
    model = load_model(str(tmp_path), device="cpu", dtype=torch.float32)
    x = torch.randn(2, 5, 64)
    cos, sin = model.rope(torch.arange(5).expand(2, 5), torch.float32)
    with Ops() as ops:
        model.model.layers[0].self_attn(x, cos, sin, None, None)
    assert not [n for n in ops.names if n.startswith(("aten.neg", "aten.cat"))]
