"""The generic Hugging Face path: any `AutoModelForCausalLM` module behind the call shapes lichen's model has.

`HFCausalLM` wraps the transformers module so the trainer and lichen's engines use it as they use
lichen.models.CausalLM: `model(input_ids, position_ids, attn_mask=...)` returns the final hidden states and
`model.logits(hidden)` applies the LM head, so log-probs are the same function of the logits on both sides
(docs/architecture.md#log-prob-convention). The wrapper registers the module's own children, so parameter names
are the module's (`model.layers.0...`, `lm_head.weight`): weight sync and exports use the names
`from_pretrained` reads back. For MoE types transformers 5 keeps fused expert tensors in the module
(`mlp.experts.gate_up_proj`) while hub checkpoints store one tensor per expert; both load with `from_pretrained`.

Packed training rows (several samples per row, a block-diagonal mask) are unpacked here into one sample per row:
linear-attention and sliding-window layers cannot be told where a packed sample starts by a mask, so each sample
runs alone, exactly as the engine saw it. Decoding (lichen.engines.core.hf_decode) goes through `decode`, which uses
the module's own cache (transformers' DynamicCache or the model's cache class).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lichen.errors import ConfigError
from lichen.models.packed_attention import PackedLayout


@dataclass
class HFModelInfo:
    """What lichen reads of an HF module's config (the engine compares these when it loads a checkpoint)."""

    model_type: str
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_layers: int
    hidden_size: int  # the width of the hidden states forward() returns (the PPO critic's value head reads it)
    # Nominal attention shape, for the server's KV-capacity estimate only (MLA and linear-attention layers store
    # less per token than this says).
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: Any) -> "HFModelInfo":
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = int(getattr(text, "num_attention_heads", 1) or 1)
        return cls(
            model_type=config.model_type,
            vocab_size=text.vocab_size,
            max_position_embeddings=int(getattr(text, "max_position_embeddings", None) or 4096),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            num_layers=int(getattr(text, "num_hidden_layers", 0)),
            hidden_size=int(text.hidden_size),
            num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
        )


class HFCausalLM(nn.Module):
    """An `AutoModelForCausalLM` module with lichen's model interface (see the module docstring)."""

    is_hf = True
    hf: Any  # the transformers module, set in __init__ through __dict__ (not a submodule)

    def __init__(self, module: nn.Module, *, trust_remote_code: bool = False):
        super().__init__()
        self.trust_remote_code = trust_remote_code
        self.__dict__["hf"] = module  # not a submodule: its children are registered directly, names unchanged
        for name, child in module.named_children():
            self.add_module(name, child)
        self.cfg = HFModelInfo.from_config(module.config)
        self._softcap = getattr(module.config, "final_logit_softcapping", None)

    @property
    def base(self) -> nn.Module:
        return getattr(self.hf, self.hf.base_model_prefix)

    @property
    def gradient_checkpointing(self) -> bool:
        return self.__dict__.get("_checkpointing", False)

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, on: bool) -> None:
        if on:
            self.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif self.gradient_checkpointing:
            self.hf.gradient_checkpointing_disable()
        self.__dict__["_checkpointing"] = bool(on)

    def train(self, mode: bool = True) -> "HFCausalLM":
        self.hf.train(mode)  # the module's own flag too: some forward paths read it
        return super().train(mode)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.hf.get_output_embeddings().weight

    @property
    def lm_head_bias(self) -> torch.Tensor | None:
        return getattr(self.hf.get_output_embeddings(), "bias", None)

    @property
    def logit_softcap(self) -> float | None:
        """Gemma-2 style final soft-capping c (logits = c * tanh(l / c)), None when the model has none."""
        return self._softcap or None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.hf.get_output_embeddings()(hidden)
        if self._softcap:  # gemma-2 style final soft-capping, as the module's own forward applies it
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    def decoder_layers(self) -> list[nn.Module]:
        """The module's decoder layers, in order (one FSDP2 unit each, lichen.train.fsdp): the modules of the
        classes the module names in `_no_split_modules` (transformers' own list of blocks that must stay whole),
        else `<base>.layers`."""
        names = set(getattr(self.hf, "_no_split_modules", None) or ())
        found = [m for m in self.base.modules() if type(m).__name__ in names]
        if found:
            return found
        layers = getattr(self.base, "layers", None)
        if isinstance(layers, nn.ModuleList):
            return list(layers)
        raise ValueError(f"{type(self.hf).__name__}: no decoder layers found (no _no_split_modules, no .layers)")

    # ---- the router's load-balancing loss (--moe-aux-loss-coeff, lichen.train.router_aux) ---------------------
    @property
    def load_balancing_loss_fn(self) -> Callable | None:
        """The module's own `load_balancing_loss_func` (defined next to its class by transformers' MoE types with an
        auxiliary loss), None for dense modules and for MoE types without one (glm4_moe, deepseek_v3: their
        routing is balanced by a score-correction bias instead)."""
        fn = getattr(sys.modules.get(type(self.hf).__module__), "load_balancing_loss_func", None)
        if fn is None or not hasattr(self.hf, "num_experts") or not hasattr(self.hf, "num_experts_per_tok"):
            return None
        return fn

    @contextlib.contextmanager
    def recording_router_logits(self) -> Iterator[None]:
        """Forwards with gradients inside this block keep each MoE layer's router logits for `router_aux_loss`."""
        self.__dict__["_record_router"] = True
        self.__dict__["_router_logits"] = None
        try:
            yield
        finally:
            self.__dict__["_record_router"] = False

    def router_aux_loss(self, token_mask: torch.Tensor) -> torch.Tensor | None:
        """The module's load-balancing loss of the last recorded forward (None when none was recorded), counting
        the tokens where `token_mask` [rows, T] (the forward's input layout) is nonzero: padding does not count.
        The unscaled value, as the module's forward computes it before multiplying by router_aux_loss_coef."""
        logits = self.__dict__.pop("_router_logits", None)
        if logits is None:
            return None
        return self.load_balancing_loss_fn(logits, self.hf.num_experts, self.hf.num_experts_per_tok, token_mask)

    def _run_base(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, back: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The decoder's last hidden states; when recording, keeps the router logits (rows of the unpacked
        layout gathered back to the caller's flat [rows * T] positions by `back`)."""
        record = self.__dict__.get("_record_router", False) and torch.is_grad_enabled()
        extra = {"output_router_logits": True} if record else {}
        out = self.base(input_ids=input_ids, position_ids=position_ids, use_cache=False, **extra)
        if record:
            logits = tuple(x.reshape(-1, x.shape[-1]) for x in out.router_logits)
            self.__dict__["_router_logits"] = logits if back is None else tuple(x.index_select(0, back) for x in logits)
        return out.last_hidden_state

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Any = None,
        attn_mask: torch.Tensor | PackedLayout | None = None,
    ) -> torch.Tensor:
        """Final hidden states [rows, T, H] of right-padded rows (causal); packed rows (a PackedLayout, or its
        dense [rows, 1, T, T] block mask) are unpacked: each sample runs as its own sequence."""
        if cache is not None:
            raise TypeError("HFCausalLM: decoding goes through decode() (lichen.engines.core.hf_decode)")
        if attn_mask is None:
            return self._run_base(input_ids, position_ids)
        if isinstance(attn_mask, PackedLayout):
            return self._forward_packed(input_ids, attn_mask.segments())
        return self._forward_packed(input_ids, _mask_segments(attn_mask))

    def _forward_packed(self, input_ids: torch.Tensor, segments: list[tuple[int, int]]) -> torch.Tensor:
        """Rows cut into `segments` (flat start, length), each run from position 0, gathered back into place."""
        rows, T = input_ids.shape
        width = max(n for _, n in segments)
        src = torch.zeros((len(segments), width), dtype=torch.long)
        back = torch.empty(rows * T, dtype=torch.long)
        for i, (start, n) in enumerate(segments):
            src[i, :n] = torch.arange(start, start + n)
            back[start : start + n] = torch.arange(i * width, i * width + n)
        dev = input_ids.device
        src, back = src.to(dev), back.to(dev)
        ids = input_ids.reshape(-1)[src]
        pos = torch.arange(width, device=dev)[None].expand(len(segments), width)
        hidden = self._run_base(ids, pos, back)
        # gathered straight into [rows, T, H] (a new tensor, not a view: FSDP2 warns about a root returning views)
        return hidden.reshape(-1, hidden.shape[-1])[back.view(rows, T)]

    def decode(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor, past: Any
    ) -> tuple[torch.Tensor, Any]:
        """One cached forward: (hidden [B, T, H], the cache). `attention_mask` [B, keys] marks real keys (left
        padding); `past` None starts a new cache of the module's own kind."""
        out = self.base(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, cache=past, use_cache=True
        )
        return out.last_hidden_state, out.cache

    def read_state(self, model_dir: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """`model_dir`'s weights under this module's parameter names (through `from_pretrained`, so both the hub
        layout and the module layout load); ValueError when its config differs."""
        module = load_hf_module(model_dir, dtype=dtype, device="cpu", trust_remote_code=self.trust_remote_code)
        theirs = HFModelInfo.from_config(module.config)
        diff = [
            f"{k}: {getattr(theirs, k)!r} (serving {getattr(self.cfg, k)!r})"
            for k in vars(self.cfg)
            if k != "max_position_embeddings" and getattr(theirs, k) != getattr(self.cfg, k)
        ]
        if diff:
            raise ValueError(f"{model_dir!r} has a different model config: {'; '.join(diff)}")
        return {n: p.detach() for n, p in HFCausalLM(module).named_parameters()}


def _mask_segments(attn_mask: torch.Tensor) -> list[tuple[int, int]]:
    """(flat start, length) of the samples of a dense [rows, 1, T, T] block mask of samples alone."""
    rows, T = attn_mask.shape[0], attn_mask.shape[-1]
    # A token's sample starts at the first key it may attend to; a run of equal starts is one sample.
    first = attn_mask[:, 0].to(torch.int8).argmax(-1).tolist()
    segments = []
    for r in range(rows):
        s = 0
        for t in range(1, T + 1):
            if t == T or first[r][t] != first[r][s]:
                segments.append((r * T + s, t - s))
                s = t
    return segments


def read_config_json(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"no config.json in {model_dir!r}: --hf-checkpoint must be a Hugging Face model directory")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_hf_module(
    model_dir: str, *, dtype: torch.dtype, device: str | torch.device, trust_remote_code: bool = False
) -> nn.Module:
    from transformers import AutoModelForCausalLM

    module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, trust_remote_code=trust_remote_code)
    return module.to(device)


def load_hf_model(
    model_dir: str,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
) -> HFCausalLM:
    """The checkpoint as `HFCausalLM` (weights through `from_pretrained`)."""
    module = load_hf_module(model_dir, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    return HFCausalLM(module, trust_remote_code=trust_remote_code)
