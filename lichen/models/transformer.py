"""The decoder-only transformer shared by the trainer and the engine (llama, qwen2, qwen3).

One implementation serves both sides so that, on one device and dtype, rollout log-probs and trainer log-probs
agree up to floating-point rounding (docs/architecture.md#shared-model-code). Parameter names are Hugging Face's,
so checkpoints load as is.

Two call shapes:
- training / scoring: `model(input_ids, position_ids)` over right-padded rows, causal attention. Pad tokens sit
  after every real token, so causal masking alone keeps them out of the real tokens' attention. Packed rows
  (several samples side by side) pass their `attn_mask=PackedLayout` (lichen.models.packed_attention): attention
  runs segment by segment.
- decoding: `model(input_ids, position_ids, cache=KVCache, attn_mask=...)`: keys and values are written into a
  preallocated cache at `cache.length` and attention reads the cache up to the new length.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lichen.models.config import ModelConfig
from lichen.models.packed_attention import PackedLayout, packed_attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x * rsqrt(mean(x^2) + eps), computed in fp32 like HF so bf16 runs match it (a float64 model stays
        # float64: exactness tests compare layouts at float64 rounding, which an fp32 cast would hide).
        dtype = x.dtype
        x32 = x.to(torch.promote_types(dtype, torch.float32))
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """inv_freq_i = theta^(-2i/d); with llama3 rope scaling, long wavelengths are stretched by `factor`."""
    d = cfg.head_dim
    # Explicit CPU device: the model may be built under `torch.device("meta")`. fp32 exactly as HF computes it.
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d))
    rs = cfg.rope_scaling
    if rs:
        kind = rs.get("rope_type", rs.get("type"))
        if kind != "llama3":
            raise NotImplementedError(f"rope scaling {kind!r} is not supported yet")
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old_len = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(is_mid, mid, scaled)
    return inv_freq.float()  # llama3 branch mixes in float64 constants


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1), as HF writes it.

    Computed as x * cos + roll(x, D/2) * cat(-sin1, sin2): one roll instead of chunk + neg + cat per call; the
    sign moves from x2 to sin1, which is exact, so the result is bit-identical (tests/test_perf_kernels.py).
    """
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


class KVCache:
    """Preallocated keys/values for every layer: [B, num_kv_heads, max_len, head_dim]."""

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, device, dtype):
        shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = [torch.empty(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.v = [torch.empty(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.length = 0  # positions filled (the same for every row: prompts are left-padded)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(
        self, x, cos, sin, cache: KVCache | None, attn_mask: torch.Tensor | PackedLayout | None
    ) -> torch.Tensor:
        B, T, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).view(B, T, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).view(B, T, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).view(B, T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        gqa = cfg.num_kv_heads != cfg.num_heads
        if isinstance(attn_mask, PackedLayout):  # packed training rows: each segment its own attention
            out = packed_attention(q, k, v, attn_mask, enable_gqa=gqa)
        elif cache is None:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=attn_mask is None, attn_mask=attn_mask, enable_gqa=gqa
            )
        else:
            start, end = cache.length, cache.length + T
            cache.k[self.layer_idx][:, :, start:end] = k
            cache.v[self.layer_idx][:, :, start:end] = v
            k_all = cache.k[self.layer_idx][:, :, :end]
            v_all = cache.v[self.layer_idx][:, :, :end]
            if attn_mask is None and T > 1:  # several new queries: each sees the cache and itself, causally
                key_pos = torch.arange(end, device=x.device)
                attn_mask = key_pos[None, :] <= torch.arange(start, end, device=x.device)[:, None]
            out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=attn_mask, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, cfg.num_heads * cfg.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache, attn_mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """`forward` returns final hidden states [B, T, H]; `logits(hidden)` applies the LM head.

    Keeping the head separate lets callers compute logits only where they need them (the last position when
    decoding, response positions when training) — the LM head is the largest matmul for real vocabularies.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # A plain fp32 attribute, not a buffer: `.to(bfloat16)` must never round the rotary frequencies.
        self._inv_freq = rope_inv_freq(cfg)
        self.gradient_checkpointing = False

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype):
        if self._inv_freq.device != position_ids.device:
            self._inv_freq = self._inv_freq.to(position_ids.device)
        freqs = position_ids[..., None].float() * self._inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        half = sin.shape[-1] // 2
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)  # what apply_rope multiplies
        return emb.cos().to(dtype)[:, None], signed_sin.to(dtype)[:, None]  # [B, 1, T, D] each

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache | None = None,
        attn_mask: torch.Tensor | PackedLayout | None = None,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(position_ids, x.dtype)
        for layer in self.model.layers:
            if self.gradient_checkpointing and self.training and cache is None:
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, None, attn_mask, use_reentrant=False)
            else:
                x = layer(x, cos, sin, cache, attn_mask)
        if cache is not None:
            cache.length += input_ids.shape[1]
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head_weight)
