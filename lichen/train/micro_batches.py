"""Turning Samples into trainer tensors and planning a global batch's micro-batches.

A step's samples are padded once on the host (`StepBatch`). A micro-batch is planned as model rows of samples
(`plan_micro_batches`): with packing (the default), several samples share a row, each with its own position ids
0, 1, ... and a block-diagonal causal attention mask, so a sample attends only to itself and computes exactly
what it would alone in a padded row, up to floating-point rounding. Samples are sorted by descending length and
placed first-fit, so little compute goes to padding. The trainer's losses are normalized by global-batch counts
(lichen.algo.aggregate_loss), so the plan changes floating-point rounding only, never the math.

Prompt sharing (`PromptGroups`, on unless --disable-prompt-sharing): samples whose prompt tokens are identical (a
GRPO group) are packed into one row as the prompt once, then each sample's response. A response attends to the
prompt and to its own earlier tokens only, with position ids continuing from len(prompt), so it computes what it
would after its own copy of the prompt; its first token is predicted from the prompt's last position, which the
samples share (autograd sums their gradients into it). The math is the unshared layout's, up to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lichen.models.packed_attention import PackedLayout, Unit
from lichen.train.sampling_mask import KeepSets
from lichen.types import Sample, Status


@dataclass
class MicroBatch:
    """Rows of tokens for the model plus a [b, R] view of the b samples' response tokens.

    `resp_index[i, k]` is the flat position (into input_ids.flatten()) whose hidden state predicts response
    token k of sample i (its row offset + prompt_length + k - 1; with a shared prompt, k = 0 is the prompt's last
    position); `resp_mask` is the loss mask (0 on padding and on failed samples). A sample contributes every token
    but its last: the last token's hidden state predicts nothing that is trained. `attn_mask` is None when every
    row holds one sample (plain causal attention), else the rows' PackedLayout: which spans attend to which
    (each sample alone causally; a shared prompt's response parts also to its prompt), computed segment by segment
    (lichen.models.packed_attention; `attn_mask.dense_mask()` is the [rows, 1, T, T] bool equivalent).
    """

    indices: list[int]  # positions of these samples in the step's flat sample list
    input_ids: torch.Tensor  # [rows, T]
    position_ids: torch.Tensor  # [rows, T]
    resp_index: torch.Tensor  # [b, R], flat positions
    resp_tokens: torch.Tensor  # [b, R]
    resp_mask: torch.Tensor  # [b, R] float
    attn_mask: PackedLayout | None = None
    keep: KeepSets | None = None  # the rollout's kept token sets of the [b, R] positions (sampling-mask replay)

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


@dataclass(frozen=True)
class PromptGroups:
    """Which samples may share their prompt in a packed row: `group[i]` is the first sample with sample i's exact
    prompt tokens (i itself when none, or when i cannot share: no response or no prompt); `prompt[i]` the prompt
    length i shares (0 when it cannot). A prompt that is a prefix of another is a different prompt."""

    group: list[int]
    prompt: list[int]

    @classmethod
    def of(cls, samples: list[Sample]) -> "PromptGroups":
        first: dict[tuple[int, ...], int] = {}
        group, prompt = [], []
        for i, s in enumerate(samples):
            p = s.prompt_length
            if s.response_length >= 1 and p >= 1:
                group.append(first.setdefault(tuple(s.tokens[:p]), i))
                prompt.append(p)
            else:
                group.append(i)
                prompt.append(0)
        return cls(group, prompt)

    def row_width(self, row: list[int], lengths: list[int]) -> int:
        """Positions a row computes: its samples' input lengths, each shared prompt counted once."""
        seen: set[int] = set()
        width = 0
        for i in row:
            width += lengths[i] - (self.prompt[i] if self.group[i] in seen else 0)
            seen.add(self.group[i])
        return width

    def units(self, order: list[int]) -> list[list[int]]:
        """`order` cut into groups of samples sharing a prompt, in order of each group's first sample."""
        out: dict[int, list[int]] = {}
        for i in order:
            out.setdefault(self.group[i], []).append(i)
        return list(out.values())


def row_width(row: list[int], lengths: list[int], sharing: PromptGroups | None = None) -> int:
    """The positions a model row computes (with `sharing`, a shared prompt once)."""
    return sharing.row_width(row, lengths) if sharing is not None else sum(lengths[i] for i in row)


def first_fit(items: list[int], lengths: list[int], capacity: int, sort: bool = True) -> list[list[int]]:
    """Bins of `items` whose lengths sum to <= capacity (an item longer than capacity gets a bin of its own),
    placed first-fit in descending length (in the given order when not `sort`)."""
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order_by_length(items, lengths) if sort else items:
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

    def __init__(self, samples: list[Sample], pad_id: int, share_prompts: bool = False):
        self.samples = samples
        self.pad_id = pad_id
        # None: every sample computes its own prompt (--disable-prompt-sharing, or a model that takes no block mask)
        self.sharing = PromptGroups.of(samples) if share_prompts else None
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
        self.resp_tokens = _pad_rows(
            [s.response_tokens if s.response_length else [] for s in samples], R, pad_id, torch.long
        )
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

    def teacher_log_probs(self, device) -> torch.Tensor:
        """[n, R] the served teacher's log-probs (--opd-type sglang; 0 on padding); every sample must have them."""
        missing = [s.index for s in self.samples if s.teacher_log_probs is None]
        short = [
            s.index
            for s in self.samples
            if s.teacher_log_probs is not None and len(s.teacher_log_probs) != s.response_length
        ]
        if missing or short:
            raise ValueError(
                f"--opd-type sglang: samples {(missing or short)[:5]} have "
                f"{'no teacher_log_probs' if missing else 'teacher_log_probs of another length than the response'}; "
                "a custom rollout must keep what lichen's rollout attached (one value per response token)"
            )
        rows = [list(s.teacher_log_probs or []) for s in self.samples]
        return _pad_rows(rows, self.max_response_length, 0.0, torch.float32).to(device)

    def micro(self, plan: Plan, device) -> MicroBatch:
        """One micro-batch laid out as `plan` (model rows of sample indices, see plan_micro_batches).

        The b samples appear in MicroBatch.indices / resp_* in row-major order of `plan`.
        """
        rows = [i for row in plan for i in row]
        T = max(row_width(row, self.input_lengths, self.sharing) for row in plan)
        R = max(max(self.response_lengths[i] for i in rows), 1)
        sel = torch.tensor(rows, dtype=torch.long)
        resp_index = self.resp_index.index_select(0, sel)[:, :R]
        if len(plan) == len(rows):  # one sample per row: plain right padding, causal attention
            input_ids = self.input_ids.index_select(0, sel)[:, :T]
            position_ids = torch.arange(T, dtype=torch.long)[None].expand(len(rows), T).contiguous()
            resp_index = resp_index + (torch.arange(len(rows), dtype=torch.long) * T)[:, None]
            attn_mask = None
        else:
            input_ids, position_ids, resp_index, attn_mask = self._packed(plan, T, resp_index)
        return MicroBatch(
            rows,
            input_ids.to(device),
            position_ids.to(device),
            resp_index.to(device),
            self.resp_tokens.index_select(0, sel)[:, :R].to(device),
            self.resp_mask.index_select(0, sel)[:, :R].to(device),
            attn_mask,
            self._keep(rows, R, device),
        )

    def _keep(self, rows: list[int], width: int, device) -> KeepSets | None:
        """The kept token sets of these samples' [b, width] response positions, None when none was recorded."""
        masks = [self.samples[i].rollout_sampling_mask for i in rows]
        keep = KeepSets.of(masks, [self.response_lengths[i] for i in rows], width, rows)
        return None if keep is None else keep.to(device)

    def _packed(self, plan: Plan, T: int, resp_index: torch.Tensor):
        """(input_ids, position_ids, flat resp_index, PackedLayout) of packed rows; `resp_index` relative to each
        sample's own start, rows in row-major order of `plan`.

        A sample alone is one unit: it attends causally within itself. Samples sharing a prompt (`sharing`) are one
        unit: the prompt once, then each response part, whose queries also see the whole prompt
        (lichen.models.packed_attention).
        """
        rows = len(plan)
        input_ids = torch.full((rows, T), self.pad_id, dtype=torch.long)
        position_ids = torch.zeros((rows, T), dtype=torch.long)
        starts, first_pred = [], []  # per sample: flat start of its own layout; flat position predicting token 0
        layout: list[tuple[Unit, ...]] = []

        def lay(r: int, off: int, i: int, lo: int, hi: int) -> None:  # sample i's input tokens lo:hi at `off`
            input_ids[r, off : off + hi - lo] = self.input_ids[i, lo:hi]
            position_ids[r, off : off + hi - lo] = torch.arange(lo, hi)

        units = self.sharing.units if self.sharing is not None else (lambda row: [[i] for i in row])
        for r, row in enumerate(plan):
            off = 0
            row_units = []
            for unit in units(row):
                if len(unit) == 1:
                    i = unit[0]
                    lay(r, off, i, 0, self.input_lengths[i])
                    row_units.append(Unit(off, self.input_lengths[i]))
                    starts.append(r * T + off)
                    first_pred.append(-1)  # the usual prompt_length - 1 of its own layout
                    off += self.input_lengths[i]
                    continue
                p = self.sharing.prompt[unit[0]]
                lay(r, off, unit[0], 0, p)
                unit_start, last = off, r * T + off + p - 1
                off += p
                parts = []
                for i in unit:
                    n = self.input_lengths[i] - p
                    lay(r, off, i, p, p + n)
                    parts.append(n)
                    starts.append(r * T + off - p)  # as if its own prompt lay just before its response part
                    first_pred.append(last)
                    off += n
                row_units.append(Unit(unit_start, p, tuple(parts)))
            layout.append(tuple(row_units))
        # `starts`/`first_pred` follow the row's units; MicroBatch order is the plan's row-major order
        laid = [i for row in plan for unit in units(row) for i in unit]
        where = {i: k for k, i in enumerate(laid)}
        perm = torch.tensor([where[i] for row in plan for i in row], dtype=torch.long)
        start = torch.tensor(starts, dtype=torch.long)[perm]
        first = torch.tensor(first_pred, dtype=torch.long)[perm]
        resp_index = resp_index + start[:, None]
        resp_index[:, 0] = torch.where(first >= 0, first, resp_index[:, 0])
        return input_ids, position_ids, resp_index, PackedLayout(T, tuple(layout))


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


def plan_micro_batches(
    indices: list[int],
    lengths: list[int],
    *,
    micro_batch_size: int,
    max_tokens: int | None,
    sort: bool = True,
    pack: bool = True,
    sharing: PromptGroups | None = None,
    flops_coeff: float | None = None,
) -> list[Plan]:
    """Micro-batches of `indices`, each a list of model rows, each row a list of sample indices.

    - token budget (`max_tokens` set): computed size rows x widest row <= max_tokens (a single sample longer than
      the budget gets a micro-batch of its own). With `pack`, all samples are first placed first-fit-decreasing
      into rows of capacity min(longest sample, max_tokens), and consecutive rows form micro-batches; without,
      one sample per row.
    - else `micro_batch_size` samples per micro-batch; with `pack`, first-fit-decreasing into rows as wide as the
      micro-batch's longest sample.
    `sort` orders samples by descending length first (similar lengths share micro-batches and rows). With `pack`
    and `sharing`, the placed items are groups of samples sharing a prompt (width: the prompt once plus each
    sample's response part), so a group lands in one row, which then computes its prompt once.
    `flops_coeff` (--balance-by-flops, with `max_tokens`): slime's split instead of the token budget,
    ceil(tokens / max_tokens) micro-batches balanced by estimated FLOPs (lichen.train.flops_balance), each laid out
    as a fixed-size chunk is.
    """
    order = order_by_length(indices, lengths) if sort else list(indices)
    if flops_coeff is not None and max_tokens:
        from lichen.train.flops_balance import balanced_micro_batches

        chunks = balanced_micro_batches(order, lengths, max_tokens, flops_coeff)
        return [lay_out(mb, lengths, pack=pack, sharing=sharing, sort=sort) for mb in chunks]
    if pack and sharing is not None:
        return _plan_shared(
            order, lengths, sharing, micro_batch_size=micro_batch_size, max_tokens=max_tokens, sort=sort
        )
    if max_tokens:
        if not pack:
            return [[[i] for i in mb] for mb in split_by_tokens(order, lengths, max_tokens)]
        if not order:
            return []
        capacity = min(max(lengths[i] for i in order), max_tokens)
        return group_rows(first_fit(order, lengths, capacity, sort=sort), lengths, max_tokens)
    return [lay_out(mb, lengths, pack=pack, sort=sort) for mb in split_fixed(order, micro_batch_size)]


def lay_out(
    chunk: list[int], lengths: list[int], *, pack: bool, sort: bool, sharing: PromptGroups | None = None
) -> Plan:
    """The rows of one micro-batch of `chunk`'s samples: one sample per row, or with `pack` placed
    first-fit-decreasing into rows as wide as its widest item (with `sharing`, the items are its groups of samples
    sharing a prompt)."""
    if not pack:
        return [[i] for i in chunk]
    if sharing is None:
        return first_fit(chunk, lengths, max(lengths[i] for i in chunk), sort=sort)
    units = sharing.units(chunk)
    widths = [sharing.row_width(u, lengths) for u in units]
    return [
        [i for k in row for i in units[k]] for row in first_fit(list(range(len(units))), widths, max(widths), sort=sort)
    ]


def _plan_shared(
    order: list[int],
    lengths: list[int],
    sharing: PromptGroups,
    *,
    micro_batch_size: int,
    max_tokens: int | None,
    sort: bool,
) -> list[Plan]:
    """plan_micro_batches with packing over groups of samples sharing a prompt (see there)."""
    width = lambda unit: sharing.row_width(unit, lengths)  # noqa: E731

    def rows_of(units: list[list[int]], capacity: int) -> list[list[int]]:
        widths = [width(u) for u in units]
        return [
            [i for k in row for i in units[k]]
            for row in first_fit(list(range(len(units))), widths, capacity, sort=sort)
        ]

    units = sharing.units(order)
    if sort:
        units.sort(key=lambda u: -width(u))
    if max_tokens:
        # a group wider than the budget is cut into pieces that fit (each piece computes its own prompt copy)
        units = [piece for u in units for piece in _greedy_pieces(u, width, max_tokens)]
        if not units:
            return []
        rows = rows_of(units, min(max(width(u) for u in units), max_tokens))
        return _greedy_groups(rows, width, max_tokens)
    chunks = split_fixed([i for u in units for i in u], micro_batch_size)
    return [lay_out(chunk, lengths, pack=True, sort=sort, sharing=sharing) for chunk in chunks]


def _greedy_pieces(unit: list[int], width_of, max_width: int) -> list[list[int]]:
    """`unit` cut, in order, into pieces of width <= max_width (a sample wider than that alone)."""
    pieces: list[list[int]] = [[]]
    for i in unit:
        if pieces[-1] and width_of(pieces[-1] + [i]) > max_width:
            pieces.append([])
        pieces[-1].append(i)
    return pieces if pieces[0] else []
