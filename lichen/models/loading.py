"""Loading a checkpoint into the shared model code: lichen's own implementation or the generic HF path.

`--model-impl auto` (the default) uses lichen's implementation for the types it has (lichen.models.config
SUPPORTED_MODEL_TYPES) and the generic HF path (lichen.models.hf_model) for every other type; `lichen` and `hf`
force one. The choice is logged once per load.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from lichen.errors import ConfigError
from lichen.models.config import SUPPORTED_MODEL_TYPES, ModelConfig

if TYPE_CHECKING:  # torch loads with the model code, not with the --dry-run checks that resolve --model-impl
    import torch

    from lichen.models.transformer import CausalLM

MODEL_IMPLS = ("auto", "lichen", "hf")
log = logging.getLogger(__name__)


def resolve_model_impl(model_type: str | None, impl: str = "auto") -> str:
    """ "lichen" or "hf" for a checkpoint of `model_type` under --model-impl `impl`."""
    if impl not in MODEL_IMPLS:
        raise ConfigError(f"--model-impl {impl!r}: choose one of {', '.join(MODEL_IMPLS)}")
    if impl == "lichen" and model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"--model-impl lichen: model_type {model_type!r} has no lichen implementation (lichen "
            f"implements {', '.join(SUPPORTED_MODEL_TYPES)}); use --model-impl auto or hf"
        )
    if impl == "auto":
        return "lichen" if model_type in SUPPORTED_MODEL_TYPES else "hf"
    return impl


def load_model(
    model_dir: str,
    *,
    device: "str | torch.device" = "cpu",
    dtype: "torch.dtype | None" = None,
    impl: str = "auto",
    trust_remote_code: bool = False,
    gdn_backend: str | None = None,
):
    """The model for `model_dir` (a CausalLM, or an HFCausalLM on the generic path) with its weights; fp32 unless
    `dtype` is given."""
    import torch

    from lichen.models.hf_model import read_config_json

    dtype = torch.float32 if dtype is None else dtype
    model_type = read_config_json(model_dir).get("model_type")
    chosen = resolve_model_impl(model_type, impl)
    # the default choice (lichen's own code for a type it implements) is quiet; the generic path is announced
    (log.debug if impl == "auto" and chosen == "lichen" else log.info)(
        "model %s: model_type %s, --model-impl %s -> %s implementation", model_dir, model_type, impl, chosen
    )
    from lichen.models.sharded_load import active_sharded_load, load_lichen_model_sharded

    sharded = active_sharded_load()
    if chosen == "hf":
        from lichen.models.gdn_backend import apply_gdn_backend
        from lichen.models.hf_model import load_hf_model
        from lichen.models.sharded_load import load_hf_model_sharded

        apply_gdn_backend(model_type, gdn_backend)
        if sharded is not None:  # built on meta, sharded, this rank's slices read (when the names are the module's)
            model = load_hf_model_sharded(
                model_dir, device=device, dtype=dtype, spec=sharded, trust_remote_code=trust_remote_code
            )
            if model is not None:
                return model
            log.info(
                "model %s: its tensor names are not the module's (from_pretrained converts them): every rank "
                "loads the full model, then shards it",
                model_dir,
            )
        return load_hf_model(model_dir, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    if sharded is not None:  # a multi-rank trainer: built on meta, sharded, only this rank's slices read
        return load_lichen_model_sharded(model_dir, device=device, dtype=dtype, spec=sharded)
    return load_lichen_model(model_dir, device=device, dtype=dtype)


def load_lichen_model(model_dir: str, *, device: "str | torch.device", dtype: "torch.dtype") -> "CausalLM":
    """Build lichen's model for `model_dir`'s config.json and load its safetensors weights (HF parameter names)."""
    import torch

    from lichen.models.transformer import CausalLM
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
        raise ValueError(
            f"{model_dir}: weights do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return model.to(dtype=dtype)
