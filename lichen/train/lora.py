"""LoRA on the trainer's policy, built on peft (docs/lora.md).

`apply_lora` injects peft's LoRA layers into the policy module in place (parameter names keep Hugging Face's
module path: `...q_proj.base_layer.weight`, `...q_proj.lora_A.default.weight`) and freezes every other weight,
so the trainer's optimizer, built over the parameters that require gradients, holds the adapters only. Linear
modules get peft's `lora.Linear`; the routed experts' stacked 3-D parameters (`mlp.experts.gate_up_proj`) get
peft's `ParamWrapper` (`target_parameters`: one rank-r pair per expert; two wrappers nest on one experts module,
so its base parameter reads `mlp.experts.base_layer.base_layer.gate_up_proj`). Around it:
- the engines get merged full weights, W + alpha/r * B A under the base names (`merged_named_weights`), so
  they run the plain model and the trainer's unmerged forward equals theirs up to rounding;
- the reference policy is the same module with its adapters disabled (`ReferencePolicy`), no second model;
- adapters are saved as peft's adapter directory (`save_adapter`: adapter_config.json +
  adapter_model.safetensors, keys as `PeftModel.save_pretrained` writes them), which `PeftModel.from_pretrained`
  loads onto the transformers model of the base checkpoint, and which `--lora-load` and a resume read back.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import zlib
from collections.abc import Callable, Iterable, Iterator

import safetensors.torch
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model_state_dict, inject_adapter_in_model, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from peft.tuners.lora.layer import ParamWrapper
from torch import nn
from torch.distributed.tensor import DTensor

from lichen.config.lora_config import NEVER_ADAPTED, LoraConfig
from lichen.errors import ConfigError
from lichen.weights.hf_io import save_hf_checkpoint

ADAPTER = "default"  # peft's adapter name; lichen trains one adapter
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."  # what PeftModel.save_pretrained puts before the module path


def target_names(model: nn.Module) -> tuple[list[str], list[str]]:
    """(Linear module names, routed experts' stacked parameter names) of `model`: what a LoRA selection picks from.
    lichen.config.lora.checkpoint_targets reads the same names from a checkpoint."""
    linear = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    stacked = [name for name, p in model.named_parameters() if p.dim() == 3 and _EXPERT_PARAM.search(name)]
    return linear, stacked


_EXPERT_PARAM = re.compile(r"(?:^|\.)experts\.[^.]+$")  # a parameter of the experts module itself (not experts.N.*)


def apply_lora(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """Inject adapters into the Linear modules and stacked expert parameters `cfg` selects (in place) and freeze
    everything else; returns the adapted names. Raises ConfigError when the selection is empty or names an
    embedding / the LM head."""
    linear, stacked = target_names(model)
    names = cfg.adapted(linear + stacked)
    never = [n for n in names if NEVER_ADAPTED.search(n)]
    if never:
        raise ConfigError(f"--lora-target-modules selects {never[0]}: embeddings and the LM head are never adapted")
    if not names:
        raise ConfigError(
            f"--use-lora adapts no Linear module of the policy (its Linear modules: "
            f"{', '.join(linear[:6])}, ...); choose a preset or --lora-target-modules that match"
        )
    inject_adapter_in_model(peft_config(cfg, names, stacked), model, adapter_name=ADAPTER)
    for pname, p in model.named_parameters():
        p.requires_grad_(".lora_" in pname)
    return names


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """Set every adapter to lichen's initial value, the same whatever the model's layout (whole on one rank, or
    FSDP2 shards of a model built on `meta`, where peft's own random init happened on no real memory): A
    kaiming-uniform (a=sqrt(5), peft's default) from a generator seeded by (`seed`, its name), B zero, so the
    merged policy starts as the base model. A sharded adapter keeps its own rows of the full value."""
    from lichen.models.sharded_load import owned_region

    for name, p in model.named_parameters():
        if ".lora_" not in name:
            continue
        full = torch.zeros(tuple(p.shape), dtype=p.dtype)
        if ".lora_A." in name:
            gen = torch.Generator().manual_seed((int(seed) << 32) ^ zlib.crc32(name.encode("utf-8")))
            nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=gen)
        local = p.to_local() if isinstance(p, DTensor) else p
        local.copy_(full[owned_region(p)].to(local.device))


def adapter_source(name: str) -> str | None:
    """The checkpoint tensor a tensor of the adapted model reads when it is built sharded
    (lichen.models.sharded_load.ShardedLoad.source): a base weight its name without peft's `base_layer`, an
    adapter none (init_adapters sets it)."""
    return None if ".lora_" in name else unwrapped_name(name)


def peft_config(cfg: LoraConfig, names: list[str], stacked: list[str], base: str | None = None) -> PeftLoraConfig:
    """peft's config for the adapted `names`: Linear modules as target_modules, the stacked expert parameters among
    them (`stacked`) as target_parameters."""
    is_param = set(stacked)
    params = [n for n in names if n in is_param]
    modules = [n for n in names if n not in is_param]
    return PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=0.0,
        bias="none",
        target_modules=modules or None,
        target_parameters=params or None,
        task_type="CAUSAL_LM",
        base_model_name_or_path=base,
    )


def lora_layers(model: nn.Module) -> Iterator[tuple[str, LoraLayer]]:
    for name, m in model.named_modules():
        if isinstance(m, LoraLayer):
            yield name, m


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Run `model` as the base model: every LoRA layer computes its base layer's output only."""
    layers = [m for _, m in lora_layers(model)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)


class ReferencePolicy:
    """The reference model of a LoRA run: the policy module with its adapters disabled (the base weights, which
    never train). Called like the model; lichen.train.log_probs reads it under no_grad."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        with adapters_disabled(self.model):
            return self.model(*args, **kwargs)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)  # the LM head is never adapted

    # the LM head's parts, for chunked log-probs (lichen.train.chunked_logprobs.LMHead.of)
    lm_head_weight = property(lambda self: self.model.lm_head_weight)
    lm_head_bias = property(lambda self: getattr(self.model, "lm_head_bias", None))
    logit_softcap = property(lambda self: getattr(self.model, "logit_softcap", None))

    def modules(self) -> Iterator[nn.Module]:
        return self.model.modules()  # the multi-rank trainer reshards the policy's FSDP units after a no-grad pass


def unwrapped_name(name: str) -> str:
    """A parameter's name in the model without adapters: peft's `.base_layer` pieces removed (nested ones too)."""
    return name.replace(".base_layer", "")


def _adapted_weights(model: nn.Module) -> dict[str, LoraLayer]:
    """Unwrapped name of each adapted weight -> the LoRA layer that computes its delta."""
    return {hf_name: layer for hf_name, (_, layer) in _adapted_with_names(model).items()}


def _adapted_with_names(model: nn.Module) -> dict[str, tuple[str, LoraLayer]]:
    """Unwrapped name of each adapted weight -> (the LoRA layer's module name, the layer)."""
    out = {}
    for name, layer in lora_layers(model):
        leaf = layer.parameter_name if isinstance(layer, ParamWrapper) else "weight"
        out[f"{unwrapped_name(name)}.{leaf}"] = (name, layer)
    return out


def _delta(layer: LoraLayer, a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """alpha/r * B A from full factors: a Linear's [out, in]; for stacked experts peft's layout (A [E*r, in], B
    [out, r*E], the expert index fastest in B) gives B_e A_e per expert, [E, out, in], or [E, in, out] where the
    experts module says `is_transposed` (gpt-oss), as peft's ParamWrapper reads it."""
    scale = layer.scaling[ADAPTER]
    if weight.dim() == 2:
        return scale * (b @ a)
    n_exp = weight.shape[0]
    rank = a.shape[0] // n_exp
    per_expert = torch.bmm(b.reshape(b.shape[0], rank, n_exp).permute(2, 0, 1), a.reshape(n_exp, rank, -1))
    transposed = getattr(layer.get_base_layer(), "is_transposed", False)
    return scale * (per_expert.transpose(1, 2) if transposed else per_expert)


MergedSource = tuple[str, "tuple[str, str, LoraLayer] | None"]


def _source(name: str, adapted: dict[str, tuple[str, LoraLayer]]) -> tuple[str, MergedSource] | None:
    """(the engines' name, its MergedSource) of the adapted model's tensor `name`; None for an adapter."""
    if ".lora_" in name:
        return None
    hf_name = unwrapped_name(name)
    if hf_name not in adapted:
        return hf_name, (name, None)
    owner, layer = adapted[hf_name]
    return hf_name, (name, (f"{owner}.lora_A.{ADAPTER}.weight", f"{owner}.lora_B.{ADAPTER}.weight", layer))


@torch.no_grad()
def merge_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The merged policy from `state`, the adapted `model`'s tensors by name as full tensors (the multi-rank
    trainer gathers them; its parameters are shards): like merged_named_weights, computed from `state`'s factors;
    entries other than adapters and adapted weights (buffers, a tied head's second name) pass through."""
    adapted = _adapted_with_names(model)
    out = {}
    for name, w in state.items():
        src = _source(name, adapted)
        if src is None:
            continue
        hf_name, (_, adapter) = src
        if adapter is None:
            out[hf_name] = w
        else:
            out[hf_name] = w + _delta(adapter[2], state[adapter[0]], state[adapter[1]], w).to(w.dtype)
    return out


def merged_sources(model: nn.Module, names: Iterable[str] | None = None) -> dict[str, MergedSource]:
    """Each tensor of the merged policy (the engines' names, in merged_named_weights' order; or, with `names`, the
    adapted model's state-dict names, as merge_state's export) -> (the tensor of the adapted `model` holding its
    base value, and for an adapted weight (its lora_A, its lora_B parameter names, the LoRA layer)): what a sender
    or a streamed export gathers to build it."""
    adapted = _adapted_with_names(model)
    names = [n for n, _ in model.named_parameters()] if names is None else names
    return dict(src for name in names if (src := _source(name, adapted)) is not None)


@torch.no_grad()
def gather_merged(
    full: Callable[[list[str]], Iterator[tuple[str, torch.Tensor]]],
    sources: dict[str, MergedSource],
    names: list[str],
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, merged tensor) for each of `names` (merged_sources' keys), one at a time: `full(parameter names)`
    yields each parameter's full value (on a multi-rank trainer an all-gather per tensor, the same order on every
    rank); an adapted weight is W + alpha/r B A from its three, computed as merge_state does, then dropped."""
    wanted: list[str] = []
    for name in names:
        base, adapter = sources[name]
        wanted += [base] if adapter is None else [base, adapter[0], adapter[1]]
    values = full(wanted)
    for name in names:
        base, adapter = sources[name]
        w = next(values)[1]
        if adapter is None:
            yield name, w
            continue
        a, b = next(values)[1], next(values)[1]
        yield name, w + _delta(adapter[2], a, b, w).to(w.dtype)


@torch.no_grad()
def merged_named_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of the merged policy: each adapted weight is W + alpha/r * B A (a new tensor; per expert
    for stacked expert parameters), every other tensor is the module's own; names and order are those of the
    model without adapters."""
    layers = _adapted_weights(model)
    for name, p in model.named_parameters():
        if ".lora_" in name:
            continue
        hf_name = unwrapped_name(name)
        if hf_name in layers:
            yield hf_name, p.detach() + layers[hf_name].get_delta_weight(ADAPTER).to(p.dtype)
        else:
            yield hf_name, p.detach()


def adapter_state(model: nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The adapters' tensors under peft's saved names (`model.layers.0.self_attn.q_proj.lora_A.weight`): the
    model's own, or those of `state` (the model's tensors by name, gathered from the shards of a multi-rank run)."""
    return {k: v.detach() for k, v in get_peft_model_state_dict(model, state_dict=state, adapter_name=ADAPTER).items()}


def load_adapter_state(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Copy `state` (adapter_state's layout) into the adapters; ConfigError when it is not this model's set."""
    own = adapter_state(model)
    if set(state) != set(own):
        missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        raise ConfigError(
            f"{source}: its adapters are not this run's (missing {missing[:2]}, unexpected "
            f"{extra[:2]}); use the same --lora-target-preset / --lora-target-modules it was saved with"
        )
    bad = [k for k in own if own[k].shape != state[k].shape]
    if bad:
        raise ConfigError(
            f"{source}: {bad[0]} has shape {tuple(state[bad[0]].shape)}, this run's "
            f"{tuple(own[bad[0]].shape)}; use the --lora-rank it was saved with"
        )
    set_peft_model_state_dict(model, state, adapter_name=ADAPTER)


def save_adapter(
    model: nn.Module, cfg: LoraConfig, directory: str, base: str, state: dict[str, torch.Tensor] | None = None
) -> None:
    """Write peft's adapter directory: adapter_model.safetensors (fp32) + adapter_config.json; the adapters are the
    model's own, or `state`'s (adapter_state)."""
    os.makedirs(directory, exist_ok=True)
    adapted = list(_adapted_weights(model))  # Linear modules: "<module>.weight"; stacked experts: the parameter
    names = [n.removesuffix(".weight") for n in adapted]
    stacked = [n for n in adapted if not n.endswith(".weight")]
    tensors = {_PEFT_PREFIX + k: v.contiguous().cpu() for k, v in adapter_state(model, state).items()}
    safetensors.torch.save_file(tensors, os.path.join(directory, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    peft_config(cfg, names, stacked, base=os.path.abspath(base)).save_pretrained(directory)


def read_adapter(directory: str) -> dict[str, torch.Tensor]:
    """adapter_state's layout from a directory save_adapter (or PeftModel.save_pretrained) wrote."""
    path = os.path.join(directory, ADAPTER_WEIGHTS)
    if not os.path.isfile(path):
        raise ConfigError(f"{directory}: no {ADAPTER_WEIGHTS}; give a directory --save-lora wrote")
    return {k.removeprefix(_PEFT_PREFIX): v for k, v in safetensors.torch.load_file(path).items()}


def save_exports(
    trainer,
    merged: dict[str, torch.Tensor],
    rollout_id: int,
    hf_checkpoint: str,
    state: dict[str, torch.Tensor] | None = None,
) -> None:
    """--save-lora and --lora-save-merged-hf: the adapters (the model's own, or `state`'s) and the merged policy,
    {rollout_id} filled in."""
    cfg: LoraConfig = trainer.cfg.lora
    if cfg.save_lora:
        save_adapter(trainer.model, cfg, cfg.save_lora.format(rollout_id=rollout_id), hf_checkpoint, state)
    if cfg.save_merged_hf:
        with open(os.path.join(hf_checkpoint, "config.json")) as f:
            config = json.load(f)
        save_hf_checkpoint(
            merged, cfg.save_merged_hf.format(rollout_id=rollout_id), config=config, copy_files_from=hf_checkpoint
        )


def export_rank0(
    trainer, state: dict[str, torch.Tensor], directory: str, rollout_id: int, hf_checkpoint: str
) -> dict[str, torch.Tensor]:
    """A multi-rank LoRA checkpoint, on rank 0, from `state` (the policy's tensors gathered from every rank's
    shards): writes the adapter directory `directory`, --save-lora and --lora-save-merged-hf; returns the merged
    policy (the checkpoint's hf/)."""
    merged = merge_state(trainer.model, state)
    save_adapter(trainer.model, trainer.cfg.lora, directory, hf_checkpoint, state)
    save_exports(trainer, merged, rollout_id, hf_checkpoint, state)
    return merged
