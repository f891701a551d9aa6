"""Building a model already sharded: construct it on the `meta` device, shard it (FSDP2), allocate only this rank's
shards, and read from the safetensors files only the slices this rank owns.

A multi-rank trainer (lichen.train.dist_trainer) enters `sharded_loading(...)` around the construction of its
models; `lichen.models.load_model` then takes this path for lichen's own implementation, so no rank ever holds the
whole model: the peak per rank is its shards plus one slice being copied. Without the context (one rank, the
engines, the tools) nothing changes. The generic HF path (`--model-impl hf`) takes the same path: the transformers
module is built from its config on `meta` (`AutoModelForCausalLM.from_config`), its non-persistent buffers (the
rotary `inv_freq`) recomputed by transformers' own initializer after allocation, and checked. Only a checkpoint
whose tensor names differ from the module's (hub MoE checkpoints store one tensor per expert, which only
`from_pretrained` fuses) still loads whole on every rank, logged, and is sharded afterwards.

A caller may change the model on `meta` before it is sharded (`ShardedLoad.prepare`: LoRA injects its adapters
there) and say which file tensor each model tensor reads (`ShardedLoad.source`: peft's `base_layer` names map to
the checkpoint's; adapters read none and are initialized by the caller).

Each safetensors file is opened per tensor: safetensors maps the file, and the pages a read touches count in the
process's resident set while the file stays mapped; closing it after every tensor keeps that at one slice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ContextManager

import safetensors
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from lichen.models.config import ModelConfig
from lichen.weights.hf_io import safetensors_files

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def same_name(name: str) -> str | None:
    return name


@dataclass(frozen=True)
class ShardedLoad:
    """How the caller shards a model built on `meta` (`shard(model)`, FSDP2 in place), and the memory region its
    shards are allocated in (`region()`, e.g. a torch_memory_saver tag; none by default). `prepare(model)` runs on
    the `meta` model before it is sharded; `source(name)` is the file tensor a model tensor reads (None: none).
    `device`: where the shards are allocated when not on the model's compute device (host memory under FSDP2's
    CPU offload)."""

    shard: Callable[[nn.Module], object]
    region: Callable[[], ContextManager[object]] = field(default=contextlib.nullcontext)
    prepare: Callable[[nn.Module], object] | None = None
    source: Callable[[str], str | None] = same_name
    device: str | None = None


_ACTIVE: ContextVar[ShardedLoad | None] = ContextVar("lichen_sharded_load", default=None)


@contextmanager
def sharded_loading(spec: ShardedLoad) -> Iterator[None]:
    """Within this block, `load_model` builds lichen's models on `meta`, shards them with `spec` and loads only the
    owned slices (nested blocks: the innermost wins)."""
    token = _ACTIVE.set(spec)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_sharded_load() -> ShardedLoad | None:
    """The innermost `sharded_loading` spec in effect, or None."""
    return _ACTIVE.get()


def load_lichen_model_sharded(
    model_dir: str, *, device: str | torch.device, dtype: torch.dtype, spec: ShardedLoad
) -> nn.Module:
    """lichen's model for `model_dir`, sharded by `spec.shard` before any weight is allocated; each rank reads its
    own rows of every tensor (the DTensor's local chunk) from the safetensors files."""
    from lichen.models.transformer import CausalLM

    cfg = ModelConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = CausalLM(cfg).to(dtype=dtype)
    # The rotary frequencies are a plain CPU attribute computed at construction (not a parameter or buffer), so
    # to_empty leaves them intact; a module that ever registers buffers must recompute them here.
    if any(True for _ in model.buffers()):
        raise NotImplementedError(f"{type(model).__name__} has buffers: the sharded load does not restore them")
    head = {"lm_head.weight"} if cfg.tie_word_embeddings else set()  # the tied head has no tensor of its own here
    return _materialize(model, model_dir, device=device, dtype=dtype, spec=spec, aliases=head)


def load_hf_model_sharded(
    model_dir: str, *, device: str | torch.device, dtype: torch.dtype, spec: ShardedLoad, trust_remote_code: bool
) -> nn.Module | None:
    """The transformers module for `model_dir` (as lichen.models.hf_model.HFCausalLM) built on `meta` from its
    config, sharded, each rank reading its own slices; None when the checkpoint's tensor names are not the
    module's (the caller then loads it whole through `from_pretrained`, which converts them)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lichen.models.hf_model import HFCausalLM

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        module = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    model = HFCausalLM(module, trust_remote_code=trust_remote_code)
    wanted = {n for n in _canonical_names(model)}
    if wanted - _where(model_dir).keys():  # names from_pretrained would have to convert
        return None
    return _materialize(model, model_dir, device=device, dtype=dtype, spec=spec, buffers=lambda: _hf_buffers(module))


def _materialize(
    model: nn.Module,
    model_dir: str,
    *,
    device: str | torch.device,
    dtype: torch.dtype,
    spec: ShardedLoad,
    buffers: Callable[[], None] | None = None,
    aliases: Collection[str] = (),
) -> nn.Module:
    """`model` (on meta) prepared, sharded, allocated on `device` (its shards only) and filled from `model_dir`;
    `buffers()` then recomputes the buffers the files do not hold; `aliases`: file tensors it does not read."""
    if spec.prepare is not None:
        spec.prepare(model)
    tied = {*aliases, *_canonical_names(model, aliases=True)}  # before sharding: tied tensors are one object here
    spec.shard(model)
    with spec.region():
        model.to_empty(device=spec.device or device)
    if buffers is not None:
        buffers()
    load_owned_slices(model, model_dir, dtype=dtype, tied_aliases=tied, source=spec.source)
    return model


def _canonical_names(model: nn.Module, *, aliases: bool = False) -> list[str]:
    """The state-dict names of `model` that are a tensor's first name (aliases: the later names of a tensor seen
    already, e.g. a tied LM head)."""
    seen: set[int] = set()
    first: list[str] = []
    later: list[str] = []
    for name, t in model.state_dict(keep_vars=True).items():
        (later if id(t) in seen else first).append(name)
        seen.add(id(t))
    return later if aliases else first


@torch.no_grad()
def _hf_buffers(module: PreTrainedModel) -> None:
    """Recompute the non-persistent buffers of a transformers module after `to_empty` (they are in no file): each
    owning submodule through the module's own `_init_weights` (transformers' initializer, which recomputes e.g. the
    rotary `inv_freq` from the config, as `from_pretrained` does). Raises NotImplementedError when one is left
    unset (filled with NaN first, so an initializer that skips it is seen) or its owner also has parameters."""
    owners: dict[str, nn.Module] = {}
    names = [n for n, _ in module.named_non_persistent_buffers()]
    for name in names:
        owner = module.get_submodule(name.rpartition(".")[0])
        if any(True for _ in owner.parameters(recurse=False)):
            raise NotImplementedError(f"buffer {name!r}: its module has parameters the initializer would reset")
        owners[name.rpartition(".")[0]] = owner
        buf = module.get_buffer(name)
        if buf.is_floating_point():
            buf.fill_(float("nan"))
    for owner in owners.values():
        module._init_weights(owner)
    unset = [n for n in names if module.get_buffer(n).is_floating_point() and module.get_buffer(n).isnan().any()]
    if unset:
        raise NotImplementedError(f"buffers {unset[:3]} are not recomputed by the module's initializer")


def _where(model_dir: str) -> dict[str, str]:
    """tensor name -> the safetensors file that holds it (headers only)."""
    files = safetensors_files(model_dir)
    if not files:
        raise FileNotFoundError(f"no safetensors weights in checkpoint directory {model_dir!r}")
    where: dict[str, str] = {}
    for path in files:
        with safetensors.safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name in where:
                    raise ValueError(f"tensor {name!r} appears in more than one shard of {model_dir!r}")
                where[name] = path
    return where


def owned_region(t: torch.Tensor) -> tuple[slice, ...]:
    """The index of this rank's local part of `t` in the full tensor (every dimension): a DTensor's chunk as its
    placements define it (FSDP2: Shard(0), torch.chunk's rows), the whole tensor otherwise."""
    if not isinstance(t, DTensor):
        return tuple(slice(0, n) for n in t.shape)
    local_shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, local_shape))


@torch.no_grad()
def load_owned_slices(
    model: nn.Module,
    model_dir: str,
    *,
    dtype: torch.dtype,
    tied_aliases: Collection[str] = (),
    source: Callable[[str], str | None] = same_name,
) -> None:
    """Copy into each parameter and persistent buffer of `model` (HF names) the part this rank holds, read from
    `model_dir`'s safetensors files slice by slice. Each model tensor reads the file tensor `source(name)` (None:
    none, the caller fills it); those names must match the files' exactly (names in `tied_aliases`, a tied LM
    head's second name, are skipped, and may be in the files or not)."""
    where = _where(model_dir)
    read = {}
    for name, t in model.state_dict(keep_vars=True).items():
        src_name = source(name) if name not in tied_aliases else None
        if src_name is not None:
            read[src_name] = t
    targets = read
    missing = sorted(targets.keys() - where.keys())
    unexpected = sorted(where.keys() - targets.keys() - set(tied_aliases))
    if missing or unexpected:
        raise ValueError(
            f"{model_dir}: weights do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name, t in targets.items():  # `name`: the file's
        region = owned_region(t)
        local = t.to_local() if isinstance(t, DTensor) else t
        with safetensors.safe_open(where[name], framework="pt") as f:  # per tensor: see the module docstring
            part = f.get_slice(name)
            shape = tuple(part.get_shape())
            if shape != tuple(t.shape):
                raise ValueError(f"{model_dir}: tensor {name!r} has shape {list(shape)}, the model {list(t.shape)}")
            src = part[region] if local.numel() else None
        if src is not None:
            local.copy_(src.to(dtype) if src.is_floating_point() else src)
