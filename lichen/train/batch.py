"""Turning Samples into padded tensors and splitting a global batch into micro-batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lichen.types import Sample, Status


@dataclass
class MicroBatch:
    """Right-padded rows of prompt + response tokens, plus a [b, R] view of the response tokens.

    `resp_index[i, k]` is the position whose hidden state predicts response token k of row i
    (prompt_length + k - 1); `resp_mask` is the loss mask (0 on padding and on failed samples).
    """

    indices: list[int]  # positions of these samples in the step's flat sample list
    input_ids: torch.Tensor  # [b, T]
    position_ids: torch.Tensor  # [b, T]
    resp_index: torch.Tensor  # [b, R]
    resp_tokens: torch.Tensor  # [b, R]
    resp_mask: torch.Tensor  # [b, R] float

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def make_micro_batch(samples: list[Sample], indices: list[int], pad_id: int, device) -> MicroBatch:
    rows = [samples[i] for i in indices]
    T = max(len(s.tokens) for s in rows)
    R = max(max(s.response_length for s in rows), 1)
    b = len(rows)
    input_ids = torch.full((b, T), pad_id, dtype=torch.long)
    resp_index = torch.zeros((b, R), dtype=torch.long)
    resp_tokens = torch.full((b, R), pad_id, dtype=torch.long)
    resp_mask = torch.zeros((b, R), dtype=torch.float32)
    for r, s in enumerate(rows):
        n, p, rl = len(s.tokens), s.prompt_length, s.response_length
        input_ids[r, :n] = torch.tensor(s.tokens, dtype=torch.long)
        resp_index[r, :rl] = torch.arange(p - 1, p - 1 + rl)
        resp_tokens[r, :rl] = torch.tensor(s.tokens[p:], dtype=torch.long)
        if s.status != Status.FAILED:
            lm = s.loss_mask if s.loss_mask is not None else [1] * rl
            resp_mask[r, :rl] = torch.tensor(lm, dtype=torch.float32)
    position_ids = torch.arange(T, dtype=torch.long)[None].expand(b, T).contiguous()
    return MicroBatch(
        list(indices),
        input_ids.to(device),
        position_ids.to(device),
        resp_index.to(device),
        resp_tokens.to(device),
        resp_mask.to(device),
    )


def split_fixed(indices: list[int], size: int) -> list[list[int]]:
    return [indices[i : i + size] for i in range(0, len(indices), size)]


def split_by_tokens(indices: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Greedy, order-preserving packing: a micro-batch grows while rows x longest row <= max_tokens.

    Rows are padded to the longest row of their micro-batch, so the padded size is what the budget bounds.
    A single row longer than the budget gets a micro-batch of its own.
    """
    out: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i in indices:
        n = lengths[i]
        if cur and (len(cur) + 1) * max(longest, n) > max_tokens:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    return out
