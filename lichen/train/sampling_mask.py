"""Sampling-mask replay: the token sets top-p / top-k kept at rollout, as the trainer's log-prob mask.

With top-p / top-k below the full vocabulary a token is drawn from softmax(logits / T) renormalized over the kept
set. The engine returns that set per generated position (`Sample.rollout_sampling_mask`, sorted ids) and its
log-prob over it; the trainer (policy and reference) masks the logits outside the set to -inf before the
log-softmax, so both sides score the distribution the token was drawn from (docs/architecture.md#log-prob-convention).

`KeepSets` holds the sets of N flat positions in coordinate form (row, id), never as a dense [N, V] mask: the
chunked log-prob path expands one chunk's rows at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor


@dataclass(frozen=True)
class KeepSets:
    """Kept token ids of N flat positions: `rows[m]`, `ids[m]` pairs (rows ascending); `masked[n]` is True where
    position n has a recorded set (other positions keep the full vocabulary)."""

    rows: Tensor  # [M] long
    ids: Tensor  # [M] long
    masked: Tensor  # [N] bool

    @classmethod
    def of(
        cls, per_sample: Sequence[list[list[int]] | None], lengths: Sequence[int], width: int, names: Sequence[int]
    ) -> "KeepSets | None":
        """The sets of a [b, width] block of response positions (flattened row-major), sample i's first
        `lengths[i]` positions from `per_sample[i]` (None: not truncated); None when no sample has any. `names`:
        the samples' indices in the step, for the error."""
        if all(m is None for m in per_sample):
            return None
        rows: list[int] = []
        ids: list[int] = []
        masked = torch.zeros(len(per_sample) * width, dtype=torch.bool)
        for i, (sets, n) in enumerate(zip(per_sample, lengths)):
            if sets is None:
                continue
            if len(sets) != n or any(not isinstance(t, int) or t < 0 for kept in sets for t in kept):
                raise ValueError(
                    f"sample {names[i]} of the step: rollout_sampling_mask must hold one list of token ids (ints >= 0) per "
                    f"response token ({n}), got {len(sets)} entries; regenerate the rollout or drop the field"
                )
            for k, kept in enumerate(sets[:width]):
                rows.extend([i * width + k] * len(kept))
                ids.extend(kept)
                masked[i * width + k] = True
        return cls(torch.tensor(rows, dtype=torch.long), torch.tensor(ids, dtype=torch.long), masked)

    def to(self, device: torch.device | str) -> "KeepSets":
        return KeepSets(self.rows.to(device), self.ids.to(device), self.masked.to(device))

    def dense(self, start: int, end: int, vocab: int, tokens: Tensor) -> Tensor:
        """[end - start, vocab] bool, True where positions start:end keep a token. The position's own token is
        always kept (as slime does): a set that misses it (a hostile or stale record) cannot give -inf."""
        if self.ids.numel() and int(self.ids.max()) >= vocab:
            raise ValueError(
                f"rollout_sampling_mask holds token id {int(self.ids.max())} >= the model's vocabulary ({vocab}): "
                "the rollout does not match this model"
            )
        keep = ~self.masked[start:end, None].expand(end - start, vocab).clone()
        lo, hi = torch.searchsorted(self.rows, torch.tensor([start, end], device=self.rows.device)).tolist()
        keep[self.rows[lo:hi] - start, self.ids[lo:hi]] = True
        keep[torch.arange(end - start, device=keep.device), tokens[start:end]] = True
        return keep
