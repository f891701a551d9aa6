"""What `--dry-run` checks of a checkpoint's config.json before anything loads (docs/models.md#dry-run).

lichen's own types need nothing from transformers (the dry run stays free of torch for them). Any other type goes
the generic HF path, so transformers must have a causal-LM class for it, or the checkpoint must ship its own
code (`auto_map`), which runs only with `--trust-remote-code`.
"""

from __future__ import annotations

import json
import os
from typing import Any

from lichen.errors import ConfigError
from lichen.models.config import SUPPORTED_MODEL_TYPES


def _remote_causal_lm(config: dict) -> str | None:
    auto_map = config.get("auto_map")
    if isinstance(auto_map, dict):
        return auto_map.get("AutoModelForCausalLM")
    return None


def check_loadable(config: dict, source: str, *, impl: str, trust_remote_code: bool) -> str:
    """The implementation ("lichen" or "hf") that will load `config` (config.json read from `source`), or a
    ConfigError naming why neither can."""
    from lichen.models.loading import resolve_model_impl  # no torch: loading imports torch lazily below

    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise ConfigError(f"{source}: no model_type; a Hugging Face config.json names its model_type")
    chosen = resolve_model_impl(model_type, impl)
    if chosen == "lichen":
        return chosen
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    native = model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    remote = _remote_causal_lm(config)
    if remote and not native and not trust_remote_code:
        raise ConfigError(
            f"{source}: model_type {model_type!r} loads through the checkpoint's own code "
            f"({remote}); pass --trust-remote-code to run it (it executes that code)"
        )
    if not native and not remote:
        raise ConfigError(
            f"{source}: transformers {transformers.__version__} has no causal-LM class for model_type "
            f"{model_type!r} and the checkpoint ships no code; lichen implements "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} and runs any type AutoModelForCausalLM loads"
        )
    return chosen


def check_model_flags(args: Any, model_dir: str, flag: str) -> None:
    """--model-impl / --trust-remote-code / --qwen-gdn-backend of `args` against `model_dir`'s config.json (exit 2
    naming why it cannot load); resolves args.qwen_gdn_backend for types with Gated DeltaNet layers. A config.json
    without model_type is left to the loader."""
    from lichen.models.gdn_backend import GDN_MODEL_TYPES, resolve_gdn_backend

    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{flag} {model_dir!r}: cannot read config.json as JSON ({e}); fix the file") from None
    if not isinstance(config, dict) or "model_type" not in config:
        return
    check_loadable(config, path, impl=args.model_impl, trust_remote_code=args.trust_remote_code)
    if config["model_type"] in GDN_MODEL_TYPES:
        args.qwen_gdn_backend = resolve_gdn_backend(args.qwen_gdn_backend)
