"""Attention over packed rows, one segment at a time: each sample costs its own L^2, not the row's T^2.

A packed training row (lichen.train.micro_batches) lays several samples side by side. Its layout is a list of
units, each contiguous in the row:

- a sample alone, `Unit(start, prompt=L)`: its L tokens attend causally among themselves;
- a shared prompt, `Unit(start, prompt=p, parts=(n_1, n_2, ...))`: the prompt's p tokens attend causally among
  themselves, and each response part (n_i tokens, laid after the prompt and the parts before it) attends to the
  whole prompt and causally to itself.

Positions after a row's last unit are padding; they attend causally among themselves, only so that their hidden
states stay finite (nothing reads them).

For query i of a part of n tokens after a p-token prompt, the keys are prompt[0:p] and part[0:i+1]:

    attn(q_i) = softmax(q_i . [K_prompt; K_part[:i+1]]^T / sqrt(D)) [V_prompt; V_part[:i+1]]

which is what one SDPA call over the whole row computes with the dense [T, T] block mask (`PackedLayout.dense_mask`,
kept as the reference), but that call costs T^2 per row and head however small the segments are, and the CPU
flash kernel cannot skip the masked blocks. Here a lone sample costs L^2 / 2 (a causal call) and a part
n (p + n). docs/performance.md#packed-attention-one-segment-at-a-time has the measurement.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Unit:
    """A contiguous span of a packed row: `prompt` causal tokens from `start`, then `parts` response parts that
    each see the whole prompt (no parts: a sample alone, `prompt` being its length)."""

    start: int
    prompt: int
    parts: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.prompt + sum(self.parts)


@dataclass(frozen=True)
class PackedLayout:
    """The units of each row of a [rows, width] packed micro-batch, in row order; what lichen's models take as
    `attn_mask` for packed rows."""

    width: int
    rows: tuple[tuple[Unit, ...], ...]

    def __post_init__(self) -> None:
        for r, units in enumerate(self.rows):
            at = 0
            for u in units:
                if u.start != at or u.prompt < 1 or min(u.parts, default=0) < 0:
                    raise ValueError(f"PackedLayout row {r}: unit {u} does not follow position {at}")
                at = u.end
            if at > self.width:
                raise ValueError(f"PackedLayout row {r}: its units end at {at}, past the width {self.width}")

    def segments(self) -> list[tuple[int, int]]:
        """(flat start, length) of every sample alone and every row's padding, in order; the layout of a model that
        runs each sample as its own sequence (a shared prompt is refused: it is not one sequence)."""
        out = []
        for r, units in enumerate(self.rows):
            for u in units:
                if u.parts:
                    raise ValueError("PackedLayout.segments: a shared prompt is not one sequence")
                out.append((r * self.width + u.start, u.prompt))
            end = units[-1].end if units else 0
            if end < self.width:
                out.append((r * self.width + end, self.width - end))
        return out

    def dense_mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """[rows, 1, width, width] bool, True where a query may attend to a key (the one-call reference)."""
        T = self.width
        mask = torch.zeros((len(self.rows), T, T), dtype=torch.bool)
        causal = torch.ones((T, T), dtype=torch.bool).tril()
        for r, units in enumerate(self.rows):
            end = 0
            for u in units:
                s, p = u.start, u.prompt
                mask[r, s : s + p, s : s + p] = causal[:p, :p]
                off = s + p
                for n in u.parts:
                    mask[r, off : off + n, s : s + p] = True
                    mask[r, off : off + n, off : off + n] = causal[:n, :n]
                    off += n
                end = u.end
            mask[r, end:T, end:T] = causal[: T - end, : T - end]
        return mask[:, None].to(device)


@functools.lru_cache(maxsize=512)  # every layer of every micro-batch asks for the same few (n, p); never written to
def _prompt_then_causal(n: int, p: int, device: torch.device) -> torch.Tensor:
    """[n, p + n] bool: every query sees the p prompt keys, and part keys up to its own position."""
    mask = torch.ones((n, p + n), dtype=torch.bool, device=device)
    mask[:, p:] = torch.ones((n, n), dtype=torch.bool, device=device).tril()
    return mask


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout, enable_gqa: bool = False
) -> torch.Tensor:
    """[rows, heads, T, D] attention of packed rows, computed unit by unit (see the module docstring)."""
    T = q.shape[2]
    if T != layout.width or q.shape[0] != len(layout.rows):
        raise ValueError(f"packed_attention: q is {tuple(q.shape)}, the layout {len(layout.rows)} x {layout.width}")

    def causal(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, enable_gqa=enable_gqa)

    out = []
    # split, not slicing: a split's backward is one concatenation, a slice's a zero-filled [rows, heads, T, D] each
    for units, qr, kr, vr in zip(layout.rows, q.split(1), k.split(1), v.split(1)):
        sizes = [size for u in units for size in (u.prompt, *u.parts)]
        pad = T - sum(sizes)
        qs, ks, vs = (x.split([*sizes, pad], dim=2) for x in (qr, kr, vr))
        pieces = []
        i = 0
        for u in units:
            p = u.prompt
            prompt_k, prompt_v = ks[i], vs[i]
            pieces.append(causal(qs[i], prompt_k, prompt_v))
            for n in u.parts:
                i += 1
                if n:
                    keys, values = torch.cat((prompt_k, ks[i]), dim=2), torch.cat((prompt_v, vs[i]), dim=2)
                    mask = _prompt_then_causal(n, p, q.device)
                    pieces.append(
                        F.scaled_dot_product_attention(qs[i], keys, values, attn_mask=mask, enable_gqa=enable_gqa)
                    )
            i += 1
        if pad:
            pieces.append(causal(qs[i], ks[i], vs[i]))
        out.append(torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0])
    return torch.cat(out, dim=0) if len(out) > 1 else out[0]
