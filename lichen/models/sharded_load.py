"""Building a model already sharded: construct it on the `meta` device, shard it (FSDP2), allocate only this rank's
shards, and read from the safetensors files only the slices this rank owns.

A multi-rank trainer (lichen.train.dist_trainer) enters `sharded_loading(...)` around the construction of its
models; `lichen.models.load_model` then takes this path for lichen's own implementation, so no rank ever holds the
whole model: the peak per rank is its shards plus one slice being copied. Without the context (one rank, the
engines, the tools) nothing changes. The generic HF path (`--model-impl hf`) is not converted: it loads the full
model as before (logged once per load) and the caller shards it afterwards.

Each safetensors file is opened per tensor: safetensors maps the file, and the pages a read touches count in the
process's resident set while the file stays mapped; closing it after every tensor keeps that at one slice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import ContextManager

import safetensors
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from lichen.models.config import ModelConfig
from lichen.weights.hf_io import safetensors_files


@dataclass(frozen=True)
class ShardedLoad:
    """How the caller shards a model built on `meta` (`shard(model)`, FSDP2 in place), and the memory region its
    shards are allocated in (`region()`, e.g. a torch_memory_saver tag; none by default)."""

    shard: Callable[[nn.Module], object]
    region: Callable[[], ContextManager[object]] = field(default=contextlib.nullcontext)


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
    spec.shard(model)
    with spec.region():
        model.to_empty(device=device)
    # The rotary frequencies are a plain CPU attribute computed at construction (not a parameter or buffer), so
    # to_empty leaves them intact; a module that ever registers buffers must recompute them here.
    if any(True for _ in model.buffers()):
        raise NotImplementedError(f"{type(model).__name__} has buffers: the sharded load does not restore them")
    load_owned_slices(
        model, model_dir, dtype=dtype, tied_aliases={"lm_head.weight"} if cfg.tie_word_embeddings else set()
    )
    return model


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
) -> None:
    """Copy into each parameter and persistent buffer of `model` (HF names) the part this rank holds, read from
    `model_dir`'s safetensors files slice by slice. The files' names must match the model's exactly (names in
    `tied_aliases`, a tied LM head's second name, may be present and are skipped)."""
    where = _where(model_dir)
    targets = dict(model.state_dict(keep_vars=True))
    missing = sorted(targets.keys() - where.keys())
    unexpected = sorted(where.keys() - targets.keys() - set(tied_aliases))
    if missing or unexpected:
        raise ValueError(
            f"{model_dir}: weights do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name, t in targets.items():
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
