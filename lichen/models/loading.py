"""Loading a checkpoint into the shared model code."""

from __future__ import annotations

import torch

from lichen.models.config import ModelConfig
from lichen.models.transformer import CausalLM


def load_model(model_dir: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> CausalLM:
    """Build the model for `model_dir`'s config.json and load its safetensors weights (HF parameter names)."""
    from lichen.weights.hf_io import load_hf_state_dict

    cfg = ModelConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to_empty(device=device)
    state = load_hf_state_dict(model_dir, device=str(device), dtype=dtype)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{model_dir}: weights do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.to(dtype=dtype)
