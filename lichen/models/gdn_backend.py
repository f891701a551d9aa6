"""`--qwen-gdn-backend`: the kernel behind Qwen's Gated DeltaNet (linear-attention) layers on the generic HF path.

slime's flag has the choices `fla` (flash-linear-attention's Triton kernels, slime's default) and `flashqla`
(QwenLM/FlashQLA, SM90+ GPUs). lichen adds `torch`: transformers' reference PyTorch implementation (chunked for a
prompt, recurrent for one decode step), which runs on CPU. Unset, lichen picks `fla` where CUDA and the `fla`
package are present and `torch` otherwise, and logs the choice.

transformers' qwen3_next / qwen3_5 modeling modules call two module-level functions, `torch_chunk_gated_delta_rule`
and `torch_recurrent_gated_delta_rule`, which transformers binds at import to fla's kernels when fla is installed
and to the reference code otherwise. Applying a backend rebinds those two names in the loaded modeling modules, so
the choice holds for every model of those types in the process (trainer and in-process engine alike).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
from collections.abc import Callable
from typing import Any

from lichen.errors import ConfigError

GDN_BACKENDS = ("fla", "flashqla", "torch")
GDN_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")  # types with Gated DeltaNet layers in transformers
_PACKAGES = {"fla": ("fla", "flash-linear-attention"), "flashqla": ("flash_qla", "FlashQLA (QwenLM/FlashQLA)")}
_CHUNK, _RECURRENT = "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"  # transformers' names
log = logging.getLogger(__name__)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_gdn_backend(requested: str | None) -> str:
    """The backend to run: `requested`, or the automatic choice when None. ConfigError (exit 2) when an explicit
    fla / flashqla cannot run here, naming the missing package or device."""
    if requested is None:
        chosen = "fla" if _cuda() and importlib.util.find_spec("fla") is not None else "torch"
        log.info(
            "--qwen-gdn-backend unset: using %s (%s)",
            chosen,
            "CUDA and the fla package are present" if chosen == "fla" else "needs CUDA and the fla package",
        )
        return chosen
    if requested not in GDN_BACKENDS:
        raise ConfigError(f"--qwen-gdn-backend {requested!r}: choose one of {', '.join(GDN_BACKENDS)}")
    if requested == "torch":
        return requested
    module, dist = _PACKAGES[requested]
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"--qwen-gdn-backend {requested}: the {dist} package (import {module}) is not installed; "
            "install it or use --qwen-gdn-backend torch (CPU reference implementation)"
        )
    if not _cuda():
        raise ConfigError(
            f"--qwen-gdn-backend {requested}: its kernels need a CUDA device and none is visible; use "
            "--qwen-gdn-backend torch"
        )
    if requested == "flashqla":
        raise ConfigError(
            "--qwen-gdn-backend flashqla: lichen's generic HF path does not bind FlashQLA's kernels "
            "yet; use --qwen-gdn-backend fla (or torch)"
        )
    return requested


def reference_kernel(fn: Callable, name: str) -> Callable | None:
    """transformers' plain PyTorch function `name` under whatever dispatch wraps it, or None if it cannot be found.

    transformers wraps the reference code in a dispatcher (functools.wraps, so `__wrapped__` leads back), and with
    the `kernels` package installed that dispatcher is itself wrapped in an nn.Module whose forward closes over it.
    Neither layer is a public interface, so this walks both kinds of link (``__wrapped__`` and closure cells) and
    accepts only a plain function whose code is named `name` (the reference's own code object, not a wrapper)."""
    seen: set[int] = set()
    todo: list[Any] = [fn]
    while todo:
        f = todo.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        code = getattr(f, "__code__", None)
        if code is not None and code.co_name == name and not hasattr(f, "__wrapped__"):
            return f
        if hasattr(f, "__wrapped__"):
            todo.append(f.__wrapped__)
        forward = getattr(type(f), "forward", None) if not inspect.isfunction(f) else None
        for holder in (f, forward):
            for cell in getattr(holder, "__closure__", None) or ():
                try:
                    value = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                if callable(value):
                    todo.append(value)
    return None


def _kernels(backend: str, chunk: Callable, recurrent: Callable) -> tuple[Callable, Callable]:
    """(chunked, recurrent) gated-delta-rule functions of `backend`, from transformers' bound ones."""
    if backend == "torch":
        found = [reference_kernel(f, n) for f, n in ((chunk, _CHUNK), (recurrent, _RECURRENT))]
        if found[0] is not None and found[1] is not None:
            return found[0], found[1]
        # transformers changed how it wraps them: its dispatcher still runs the reference code wherever fla does not
        # run (no fla package, or CPU inputs), which is where the torch backend is chosen automatically.
        log.warning(
            "--qwen-gdn-backend torch: transformers' reference gated-delta-rule functions were not found under its "
            "kernel dispatch; keeping transformers' dispatch (the reference code unless fla is installed and the "
            "inputs are on CUDA)"
        )
        return chunk, recurrent
    # fla: transformers bound its kernels at import (the package is importable, resolve_gdn_backend checked), and
    # its wrappers pass them only the arguments they take.
    return chunk, recurrent


def apply_gdn_backend(model_type: str | None, backend: str | None) -> str | None:
    """Bind `backend` (resolved when None) for `model_type` if it has Gated DeltaNet layers; returns the backend
    bound, or None for other types."""
    if model_type not in GDN_MODEL_TYPES:
        return None
    backend = resolve_gdn_backend(backend) if backend is None else backend
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    if not hasattr(modeling, "_lichen_gdn_original"):
        modeling._lichen_gdn_original = (
            modeling.torch_chunk_gated_delta_rule,
            modeling.torch_recurrent_gated_delta_rule,
        )
    chunk, recurrent = _kernels(backend, *modeling._lichen_gdn_original)
    modeling.torch_chunk_gated_delta_rule = chunk
    modeling.torch_recurrent_gated_delta_rule = recurrent
    log.info("%s: Gated DeltaNet layers use the %s backend", model_type, backend)
    return backend
