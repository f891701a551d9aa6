"""A shadow copy of an engine's live CPU weights that `/pull_weights` fills, so the delta is decoded once.

Without it an engine that applies deltas live decompresses every delta twice: at `/pull_weights` into its local
checkpoint, and again at `/update_weights_from_disk` into the served parameters. With a `LiveStage`, the pull
applies each payload to the local file and, from the same decompressed chunk, to `live ^ delta` in a staging
buffer (its checksum checked like the file's); the update then swaps the staging buffers in as the parameters'
storage (no copy), and the storages swapped out become the staging buffers of the next sync. The served weights
never change at pull time.

Soundness: a tensor that the deltas since the held version never touched has the same bytes at every one of
those versions, so for the first delta touching a name the old bytes are the live parameter's; later deltas in
the same stage apply to the staged bytes. A stage is used only when the local checkpoint held exactly the served
version when the pull started (same chain); any failed checksum discards it (the update then decodes the deltas
again from the published directory).

Costs one extra copy of the weights in host memory (the buffers are kept between syncs). A leaf of
lichen.weights: torch, numpy and the standard library.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import numpy as np
import torch

from lichen.weights.delta_codec import tensor_bytes


class LiveStage:
    """Staged new bytes for some of `params` (name -> live CPU contiguous tensor), on top of the served version
    `base_version` of chain `chain_id`. `spare` holds buffers from earlier stages (reused, name -> tensor)."""

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        base_version: int,
        chain_id: str | None,
        spare: dict[str, torch.Tensor] | None = None,
    ):
        for name, p in params.items():
            if p.device.type != "cpu" or not p.is_contiguous():
                raise ValueError(f"a live stage needs CPU contiguous parameters; {name!r} is not")
        self.params = params
        self.base_version, self.chain_id = base_version, chain_id
        self.version = base_version  # the version the staged bytes (and untouched live ones) are at
        self.staged: dict[str, torch.Tensor] = {}
        self.spare = spare if spare is not None else {}
        self.failed: str | None = None
        self._lock = threading.Lock()

    @property
    def usable(self) -> bool:
        return self.failed is None

    def targets(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(old bytes, where the new bytes go) for the next delta of `name` (thread-safe)."""
        with self._lock:
            buf = self.staged.get(name)
            if buf is not None:
                dst = tensor_bytes(buf)
                return dst, dst
            live = self.params[name]
            buf = self.spare.pop(name, None)
            if buf is None or buf.shape != live.shape or buf.dtype != live.dtype:
                buf = torch.empty_like(live, memory_format=torch.contiguous_format)
            self.staged[name] = buf
        return tensor_bytes(live.data), tensor_bytes(buf)

    def fail(self, why: str) -> None:
        self.failed = self.failed or why

    def swap_in(self) -> int:
        """Make the staged tensors the parameters' storage (caller holds the engine exclusively); the old storages
        become spare buffers. Returns the number of tensors swapped."""
        if self.failed:
            raise RuntimeError(f"the staged weights are unusable: {self.failed}")
        with torch.no_grad():
            for name, buf in self.staged.items():
                p = self.params[name]
                old = p.data
                p.data = buf
                self.spare[name] = old
        count = len(self.staged)
        self.staged = {}
        return count

    def release(self) -> None:
        """Give the staged buffers back to `spare` without using them."""
        self.spare.update(self.staged)
        self.staged = {}


def reserve(params: Mapping[str, torch.Tensor], spare: dict[str, torch.Tensor]) -> int:
    """Allocate (and touch) a spare buffer for every CPU parameter that lacks one, so the first staged sync does
    not pay the page faults of a fresh model-sized allocation. Returns bytes allocated."""
    allocated = 0
    for name, p in params.items():
        buf = spare.get(name)
        if p.device.type != "cpu" or (buf is not None and buf.shape == p.shape and buf.dtype == p.dtype):
            continue
        buf = torch.empty_like(p, memory_format=torch.contiguous_format)
        tensor_bytes(buf)[:] = 0
        spare[name] = buf
        allocated += buf.numel() * buf.element_size()
    return allocated
