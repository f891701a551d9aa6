"""Turning Samples into trainer tensors and planning a global batch's micro-batches.

A step's samples are padded once on the host (`StepBatch`). A micro-batch is planned as model rows of samples
(`plan_micro_batches`): with packing (the default), several samples share a row, each with its own position ids
0, 1, ... and a block-diagonal causal attention mask, so a sample attends only to itself and computes exactly
what it would alone in a padded row, up to floating-point rounding. Samples are sorted by descending length and
placed first-fit, so little compute goes to padding. The trainer's losses are normalized by global-batch counts
(lichen.algo.aggregate_loss), so the plan changes floating-point rounding only, never the math.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lichen.types import Sample, Status


@dataclass
class MicroBatch:
    """Rows of tokens for the model plus a [b, R] view of the b samples' response tokens.

    `resp_index[i, k]` is the flat position (into input_ids.flatten()) whose hidden state predicts response
    token k of sample i (its row offset + prompt_length + k - 1); `resp_mask` is the loss mask (0 on padding and
    on failed samples). A sample contributes every token but its last: the last token's hidden state predicts
    nothing that is trained. `attn_mask` is None when every row holds one sample (plain causal attention), else
    [rows, 1, T, T] bool, True where a query may attend to a key (same sample, key not after query).
    """

    indices: list[int]  # positions of these samples in the step's flat sample list
    input_ids: torch.Tensor  # [rows, T]
    position_ids: torch.Tensor  # [rows, T]
    resp_index: torch.Tensor  # [b, R], flat positions
    resp_tokens: torch.Tensor  # [b, R]
    resp_mask: torch.Tensor  # [b, R] float
    attn_mask: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def response_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """[b, R, H] hidden states at `resp_index` from the model's [rows, T, H] output."""
        b, R = self.resp_index.shape
        return hidden.flatten(0, 1).index_select(0, self.resp_index.reshape(-1)).view(b, R, hidden.shape[-1])


def _pad_rows(rows: list[list], width: int, fill, dtype: torch.dtype) -> torch.Tensor:
    """One host tensor [len(rows), width] from ragged python lists (a single conversion, not one per row)."""
    return torch.tensor([r[:width] + [fill] * (width - len(r)) for r in rows], dtype=dtype).reshape(len(rows), width)


Plan = list[list[int]]  # one micro-batch: model rows, each a list of sample indices placed side by side


def first_fit(items: list[int], lengths: list[int], capacity: int, sort: bool = True) -> list[list[int]]:
    """Bins of `items` whose lengths sum to <= capacity (an item longer than capacity gets a bin of its own),
    placed first-fit in descending length (in the given order when not `sort`)."""
    bins: list[list[int]] = []
    free: list[int] = []
    for i in (order_by_length(items, lengths) if sort else items):
        for b, room in enumerate(free):
            if lengths[i] <= room:
                bins[b].append(i)
                free[b] -= lengths[i]
                break
        else:
            bins.append([i])
            free.append(capacity - lengths[i])
    return bins


class StepBatch:
    """Every sample of a train step, right-padded once on the host.

    input_ids [n, T] holds tokens[:-1] of each sample (T = longest such row); resp_index (relative to the
    sample's own start), resp_tokens and resp_mask are [n, R] (R = longest response, at least 1).
    """

    def __init__(self, samples: list[Sample], pad_id: int):
        self.samples = samples
        self.pad_id = pad_id
        n = len(samples)
        # input length of a sample: all tokens but the last (at least one position, so empty rows stay valid)
        self.input_lengths = [max(len(s.tokens) - 1, 1) for s in samples]
        self.response_lengths = [s.response_length for s in samples]
        T = max(self.input_lengths, default=1)
        R = max(max(self.response_lengths, default=0), 1)
        self.input_ids = _pad_rows([s.tokens[:-1] for s in samples], T, pad_id, torch.long)
        prompt = torch.tensor([s.prompt_length for s in samples], dtype=torch.long).reshape(n, 1)
        k = torch.arange(R, dtype=torch.long)[None]
        inside = k < torch.tensor(self.response_lengths, dtype=torch.long).reshape(n, 1)
        self.resp_index = torch.where(inside, prompt - 1 + k, torch.zeros((), dtype=torch.long))
        self.resp_tokens = _pad_rows([s.response_tokens if s.response_length else [] for s in samples], R, pad_id,
                                     torch.long)
        masks = []
        for s in samples:
            if s.status == Status.FAILED:
                masks.append([])
            else:
                masks.append([float(x) for x in s.loss_mask] if s.loss_mask is not None else [1.0] * s.response_length)
        self.resp_mask = _pad_rows(masks, R, 0.0, torch.float32)

    @property
    def max_response_length(self) -> int:
        return self.resp_mask.shape[1]

    def rollout_log_probs(self, device) -> torch.Tensor | None:
        """[n, R] engine log-probs (0 on padding), or None when any sample lacks them."""
        if not self.samples or any(s.rollout_log_probs is None for s in self.samples):
            return None
        rows = [list(s.rollout_log_probs[: s.response_length]) for s in self.samples]
        return _pad_rows(rows, self.max_response_length, 0.0, torch.float32).to(device)

    def micro(self, plan: Plan, device) -> MicroBatch:
        """One micro-batch laid out as `plan` (model rows of sample indices, see plan_micro_batches).

        The b samples appear in MicroBatch.indices / resp_* in row-major order of `plan`.
        """
        rows = [i for row in plan for i in row]
        T = max(sum(self.input_lengths[i] for i in row) for row in plan)
        R = max(max(self.response_lengths[i] for i in rows), 1)
        sel = torch.tensor(rows, dtype=torch.long)
        resp_index = self.resp_index.index_select(0, sel)[:, :R]
        if len(plan) == len(rows):  # one sample per row: plain right padding, causal attention
            input_ids = self.input_ids.index_select(0, sel)[:, :T]
            position_ids = torch.arange(T, dtype=torch.long)[None].expand(len(rows), T).contiguous()
            start = torch.arange(len(rows), dtype=torch.long) * T
            attn_mask = None
        else:
            input_ids = torch.full((len(plan), T), self.pad_id, dtype=torch.long)
            position_ids = torch.zeros((len(plan), T), dtype=torch.long)
            segment = torch.full((len(plan), T), -1, dtype=torch.long)  # padding: a segment of its own, never empty
            starts = []
            for r, row in enumerate(plan):
                off = 0
                for i in row:
                    n = self.input_lengths[i]
                    input_ids[r, off : off + n] = self.input_ids[i, :n]
                    position_ids[r, off : off + n] = torch.arange(n)
                    segment[r, off : off + n] = i
                    starts.append(r * T + off)
                    off += n
            start = torch.tensor(starts, dtype=torch.long)
            causal = torch.ones((T, T), dtype=torch.bool).tril()
            attn_mask = ((segment[:, :, None] == segment[:, None, :]) & causal)[:, None]
        return MicroBatch(
            rows,
            input_ids.to(device),
            position_ids.to(device),
            (resp_index + start[:, None]).to(device),
            self.resp_tokens.index_select(0, sel)[:, :R].to(device),
            self.resp_mask.index_select(0, sel)[:, :R].to(device),
            None if attn_mask is None else attn_mask.to(device),
        )


def order_by_length(indices: list[int], lengths: list[int]) -> list[int]:
    """`indices` sorted by descending `lengths[i]`; ties keep their order (the sort is stable)."""
    return sorted(indices, key=lambda i: -lengths[i])


def split_fixed(indices: list[int], size: int) -> list[list[int]]:
    return [indices[i : i + size] for i in range(0, len(indices), size)]


def split_by_tokens(indices: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Greedy, order-preserving packing: a micro-batch grows while rows x longest row <= max_tokens.

    Rows are padded to the longest row of their micro-batch, so the padded size is what the budget bounds.
    A single row longer than the budget gets a micro-batch of its own.
    """
    return _greedy_groups(indices, lambda i: lengths[i], max_tokens)


def group_rows(rows: list[list[int]], lengths: list[int], max_tokens: int) -> list[list[list[int]]]:
    """Consecutive rows grouped greedily while (rows in group) x (widest row's fill) <= max_tokens."""
    return _greedy_groups(rows, lambda row: sum(lengths[i] for i in row), max_tokens)


def _greedy_groups(items: list, width_of, max_tokens: int) -> list[list]:
    """Consecutive items grouped greedily while (items in group) x (widest item) <= max_tokens: the padded size
    of the group. An item wider than the budget gets a group of its own."""
    out: list[list] = []
    cur: list = []
    widest = 0
    for item in items:
        w = width_of(item)
        if cur and (len(cur) + 1) * max(widest, w) > max_tokens:
            out.append(cur)
            cur, widest = [], 0
        cur.append(item)
        widest = max(widest, w)
    if cur:
        out.append(cur)
    return out


def plan_micro_batches(indices: list[int], lengths: list[int], *, micro_batch_size: int, max_tokens: int | None,
                       sort: bool = True, pack: bool = True) -> list[Plan]:
    """Micro-batches of `indices`, each a list of model rows, each row a list of sample indices.

    - token budget (`max_tokens` set): computed size rows x widest row <= max_tokens (a single sample longer than
      the budget gets a micro-batch of its own). With `pack`, all samples are first placed first-fit-decreasing
      into rows of capacity min(longest sample, max_tokens), and consecutive rows form micro-batches; without,
      one sample per row.
    - else `micro_batch_size` samples per micro-batch; with `pack`, first-fit-decreasing into rows as wide as the
      micro-batch's longest sample.
    `sort` orders samples by descending length first (similar lengths share micro-batches and rows).
    """
    order = order_by_length(indices, lengths) if sort else list(indices)
    if max_tokens:
        if not pack:
            return [[[i] for i in mb] for mb in split_by_tokens(order, lengths, max_tokens)]
        if not order:
            return []
        capacity = min(max(lengths[i] for i in order), max_tokens)
        return group_rows(first_fit(order, lengths, capacity, sort=sort), lengths, max_tokens)
    chunks = split_fixed(order, micro_batch_size)
    if not pack:
        return [[[i] for i in mb] for mb in chunks]
    return [first_fit(mb, lengths, max(lengths[i] for i in mb), sort=sort) for mb in chunks]
