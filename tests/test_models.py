"""lichen's model code against Hugging Face transformers, and the KV-cache paths against a full forward."""

import pytest
import torch

from lichen.models import KVCache, load_model
from lichen.models.tiny import make_tiny_model

ARCHS = ["llama", "qwen2", "qwen3"]


@pytest.fixture(scope="module", params=ARCHS)
def ckpt(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    # GQA (4 query heads, 2 kv heads), untied head: the less common paths.
    make_tiny_model(
        str(out),
        arch=request.param,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        tie_word_embeddings=False,
        seed=3,
        init_std=0.1,
    )
    return str(out)


def test_logits_match_transformers(ckpt):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
    ours = load_model(ckpt)
    ids = torch.randint(5, 100, (3, 17), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(17)[None].expand(3, 17)
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = ours.logits(ours(ids, pos))
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


def test_cache_decode_matches_full_forward(ckpt):
    model = load_model(ckpt).eval()
    ids = torch.randint(5, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(12)[None].expand(2, 12)
    with torch.no_grad():
        full = model.logits(model(ids, pos))
        cache = KVCache(model.cfg, 2, 12, "cpu", torch.float32)
        steps = [model.logits(model(ids[:, :8], pos[:, :8], cache=cache))]
        for t in range(8, 12):
            steps.append(model.logits(model(ids[:, t : t + 1], pos[:, t : t + 1], cache=cache)))
    dec = torch.cat(steps, dim=1)
    assert torch.allclose(dec, full, atol=1e-5), (dec - full).abs().max()


def test_left_padding_does_not_change_real_tokens(ckpt):
    """A left-padded row with a padding mask gives the same logits as the unpadded row alone."""
    model = load_model(ckpt).eval()
    ids = torch.randint(5, 100, (1, 6), generator=torch.Generator().manual_seed(2))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    valid = torch.tensor([[False] * 3 + [True] * 6])
    pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    mask = ((causal[None] & valid[:, None, :]) | torch.eye(9, dtype=torch.bool)[None])[:, None]
    with torch.no_grad():
        alone = model.logits(model(ids, torch.arange(6)[None]))
        cache = KVCache(model.cfg, 1, 9, "cpu", torch.float32)
        got = model.logits(model(padded, pos, cache=cache, attn_mask=mask))[:, 3:]
    assert torch.allclose(got, alone, atol=1e-5)


def test_rope_frequencies_stay_fp32_under_bf16(ckpt):
    model = load_model(ckpt, dtype=torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model._inv_freq.dtype == torch.float32
