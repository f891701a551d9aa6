"""Log-probs of given tokens (and the entropy) from final hidden states, without the [tokens, vocab] logits.

The trainer needs, per response position, log pi(token) = log_softmax(z)[token] and optionally the entropy
H = -sum_v p_v log p_v, where z = head(hidden) / T (docs/architecture.md#log-prob-convention): z = softcap(hidden @
W^T + b) / T, softcap(l) = c * tanh(l / c) when the model has one. Materialized, z and its gradient are
[tokens, vocab] tensors: at a 151,936-token vocabulary a 16k-token micro-batch holds ~10 GB of fp32 logits, and
autograd keeps several such tensors (the scaled logits, log_softmax's output, the gradients) alive at once.

`ChunkedTokenLogProbs` computes the same values in chunks of positions: the forward keeps one chunk's logits at a
time and saves only a scalar per position (the log-sum-exp, and the entropy itself) for the backward, which
recomputes each chunk's logits and accumulates the gradients of the hidden states, the LM-head weight and bias
(the LM-head matmul runs once more than materialized: the price of not storing its output). With log p = z - lse
and p = exp(log p), the gradients w.r.t. z of one position are

    d logp[token] / dz_j = [j == token] - p_j
    d H / dz_j           = -p_j (log p_j + H)

then through the temperature (1 / T) and the soft-cap (1 - tanh(l / c)^2) to l = hidden @ W^T + b.

With a sampling mask (`keep`, lichen.train.sampling_mask: top-p / top-k replay) z is -inf outside each position's
kept set before the log-sum-exp, in the forward and in the backward's recomputation: log-probs, entropy and their
gradients are those of the renormalized distribution (masked entries get p = 0 and no gradient).

Numerics follow the materialized path (`materialized_token_log_probs`, the reference the tests compare against):
the matmul and soft-cap run in the compute dtype (bfloat16 under --bf16 autocast or FSDP2's bf16 parameters, else
the inputs' dtype), the logits are promoted to at least float32 before the temperature. A float64 model stays
float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from lichen import algo
from lichen.train.sampling_mask import KeepSets


@dataclass(frozen=True)
class LMHead:
    """What turns a final hidden state into logits: l = hidden @ weight^T + bias, then c * tanh(l / c) when
    `softcap` is set (gemma-2 style final soft-capping)."""

    weight: Tensor  # [V, H]; under FSDP2 the gathered (unsharded) parameter the root's forward left registered
    bias: Tensor | None = None  # [V]
    softcap: float | None = None

    @classmethod
    def of(cls, model) -> "LMHead":
        """The LM head of a lichen model (lichen.models.CausalLM, HFCausalLM, or a wrapper exposing the same
        attributes): `lm_head_weight`, and `lm_head_bias` / `logit_softcap` where the model has them."""
        return cls(model.lm_head_weight, getattr(model, "lm_head_bias", None), getattr(model, "logit_softcap", None))

    def logits(self, hidden: Tensor) -> Tensor:
        """The head's logits in `hidden`'s dtype (what the model's own `logits` computes)."""
        weight = self.weight.to(hidden.dtype)
        bias = None if self.bias is None else self.bias.to(hidden.dtype)
        out = F.linear(hidden, weight, bias)
        if self.softcap:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out


def compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype the LM-head matmul runs in: autocast's where autocast is on for the device (as F.linear would
    under it), else the inputs' common dtype."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and hidden.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _scaled(logits: Tensor, temperature: float) -> Tensor:
    """z = logits / T in at least float32 (bf16 logits are promoted, float64 stays)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature


def _chunk_logits(h: Tensor, head: LMHead, temperature: float, out_dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """(z = head(h) / T in `out_dtype`, tanh(l / c) of the soft-cap or None) for one chunk, `head` and `h` in the
    compute dtype: the operations of `materialized_token_log_probs` (in place where they may be, to hold fewer
    [chunk, V] tensors at once)."""
    logits = F.linear(h, head.weight, head.bias)
    capped = None
    if head.softcap:
        capped = torch.tanh(logits / head.softcap)
        logits = capped * head.softcap
    # in place: the bits of `logits / T`, and `logits` (or its float32 copy) is this function's own tensor
    return logits.to(out_dtype).div_(temperature), capped


def _masked(z: Tensor, keep: KeepSets | None, start: int, tokens: Tensor) -> Tensor:
    """z [rows, V] of flat positions start:start + rows with -inf outside the kept sets (in place)."""
    if keep is None:
        return z
    return z.masked_fill_(~keep.dense(start, start + z.shape[0], z.shape[-1], tokens), float("-inf"))


def log_probs_from_logits(
    logits: Tensor, tokens: Tensor, *, temperature: float, need_entropy: bool, keep: KeepSets | None = None
) -> tuple[Tensor, Tensor | None]:
    """The plain computation over full logits [..., V] (--log-probs-chunk-size -1): (log-probs of `tokens` [...],
    entropy [...] or None), over each position's kept set where `keep` (flat positions of `tokens`) records one."""
    z = _scaled(logits, temperature)
    if keep is None:
        logp = torch.log_softmax(z, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
        return logp, (algo.entropy_from_logits(z) if need_entropy else None)
    kept = keep.dense(0, tokens.numel(), z.shape[-1], tokens.reshape(-1)).view(z.shape)
    logp_all = torch.log_softmax(z.masked_fill(~kept, float("-inf")), dim=-1)
    # masked entries: p = 0; their log p is read as 0 so p log p and its gradient are 0, not NaN
    entropy = -(logp_all.exp() * logp_all.masked_fill(~kept, 0.0)).sum(-1) if need_entropy else None
    return logp_all.gather(-1, tokens[..., None]).squeeze(-1), entropy


def materialized_token_log_probs(
    hidden: Tensor,
    head: LMHead,
    tokens: Tensor,
    *,
    temperature: float,
    need_entropy: bool,
    keep: KeepSets | None = None,
) -> tuple[Tensor, Tensor | None]:
    """`log_probs_from_logits` of `head`'s full [N, V] logits of `hidden` [N, H] (the reference the chunked
    computation is tested and benchmarked against)."""
    logits = head.logits(hidden.to(compute_dtype(hidden, head.weight)))
    return log_probs_from_logits(logits, tokens, temperature=temperature, need_entropy=need_entropy, keep=keep)


# The fewest rows a chunk has (unless the whole input has fewer): the CPU BLAS multiplies [rows, V] @ [V, H] with
# fewer than ~12 rows through a path that sums the V products with ~10x the rounding error of its blocked kernel
# (measured 1e-5 vs 2e-6 relative at V = 151,936), which the materialized [N, V] product does not pay.
MIN_CHUNK_ROWS = 16


def chunk_bounds(n: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) of the chunks of `n` positions: `chunk` each (at least MIN_CHUNK_ROWS), a remainder shorter
    than MIN_CHUNK_ROWS joined to the chunk before it."""
    chunk = max(chunk, MIN_CHUNK_ROWS)
    starts = list(range(0, n, chunk))
    if len(starts) > 1 and n - starts[-1] < MIN_CHUNK_ROWS:
        starts.pop()
    return [(s, starts[i + 1] if i + 1 < len(starts) else n) for i, s in enumerate(starts)]


class ChunkedTokenLogProbs(torch.autograd.Function):
    """(log-probs [N], entropy [N] or an empty tensor) of `tokens` [N] from `hidden` [N, H], `chunk` positions of
    logits at a time (see the module docstring). Call it through `chunked_token_log_probs`."""

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        tokens: Tensor,
        softcap: float | None,
        temperature: float,
        need_entropy: bool,
        chunk: int,
        dtype: torch.dtype,
        keep: KeepSets | None,
    ) -> tuple[Tensor, Tensor]:
        head = LMHead(weight.to(dtype), None if bias is None else bias.to(dtype), softcap)
        n = hidden.shape[0]
        out_dtype = torch.promote_types(dtype, torch.float32)
        logp = torch.empty(n, dtype=out_dtype, device=hidden.device)
        lse = torch.empty(n, dtype=out_dtype, device=hidden.device)
        entropy = torch.empty(n if need_entropy else 0, dtype=out_dtype, device=hidden.device)
        for s, e in chunk_bounds(n, chunk):
            z, _ = _chunk_logits(hidden[s:e].to(dtype), head, temperature, out_dtype)
            z = _masked(z, keep, s, tokens)
            # log p = z - logsumexp(z), as lichen.algo.entropy_from_logits computes it (log_softmax's kernel
            # rounds differently; measured less accurate against float64 at a 151,936-token vocabulary)
            lse[s:e] = torch.logsumexp(z, dim=-1)
            log_p = z.sub_(lse[s:e, None])
            logp[s:e] = log_p.gather(-1, tokens[s:e, None]).squeeze(-1)
            del z
            if need_entropy:
                # masked entries: p = 0 and log p = -inf; their p log p is 0 (not NaN)
                entropy[s:e] = log_p.exp().mul_(log_p.clamp(min=torch.finfo(out_dtype).min)).sum(dim=-1).neg_()
            del log_p
        ctx.save_for_backward(hidden, weight, bias, tokens, lse, entropy)
        ctx.config = (softcap, temperature, need_entropy, chunk, dtype, keep)
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp: Tensor | None, grad_entropy: Tensor | None):
        hidden, weight, bias, tokens, lse, entropy = ctx.saved_tensors
        softcap, temperature, need_entropy, chunk, dtype, keep = ctx.config
        want_h, want_w, want_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        if grad_entropy is not None and not need_entropy:
            grad_entropy = None
        none = (None,) * 7
        if (grad_logp is None and grad_entropy is None) or not (want_h or want_w or want_b):
            return (None, None, None) + none
        out_dtype = lse.dtype
        head = LMHead(weight.to(dtype), None if bias is None else bias.to(dtype), softcap)
        w = head.weight
        n = hidden.shape[0]
        grad_h = torch.empty_like(hidden) if want_h else None
        # accumulated over chunks in at least float32 (bf16 partial sums would lose the small chunks' terms)
        grad_w = torch.zeros(weight.shape, dtype=out_dtype, device=weight.device) if want_w else None
        grad_b = torch.zeros(bias.shape, dtype=out_dtype, device=bias.device) if want_b else None
        for s, e in chunk_bounds(n, chunk):
            h = hidden[s:e].to(dtype)
            z, capped = _chunk_logits(h, head, temperature, out_dtype)
            z = _masked(z, keep, s, tokens)
            # z becomes log p, then the per-entry factor; p * factor is d(loss)/dz without the one-hot term
            log_p = z.sub_(lse[s:e, None])
            p = log_p.exp()
            if keep is not None:  # masked entries have p = 0: a zero factor keeps their gradient 0, not NaN
                log_p.masked_fill_(torch.isneginf(log_p), 0.0)
            if grad_entropy is not None:
                # -(g_logp + g_H (log p + H))
                factor = log_p.add_(entropy[s:e, None]).mul_(grad_entropy[s:e, None])
                if grad_logp is not None:
                    factor.add_(grad_logp[s:e, None])
                grad_z = p.mul_(factor.neg_())
            else:
                assert grad_logp is not None  # one of the two is given (checked above)
                grad_z = p.mul_(-grad_logp[s:e, None])
            del log_p, z
            if grad_logp is not None:
                grad_z.scatter_add_(-1, tokens[s:e, None], grad_logp[s:e, None].to(grad_z.dtype))
            grad_z.div_(temperature)
            if capped is not None:  # d(c tanh(l / c)) / dl = 1 - tanh(l / c)^2, in the soft-cap's dtype
                grad_z.mul_(1 - capped.to(grad_z.dtype).square())
            del capped
            g = grad_z.to(dtype)
            del grad_z
            if grad_h is not None:
                grad_h[s:e] = (g @ w).to(hidden.dtype)
            if grad_w is not None:
                if g.dtype == grad_w.dtype:
                    grad_w.addmm_(g.t(), h)
                else:
                    grad_w += (g.t() @ h).to(grad_w.dtype)
            if grad_b is not None:
                grad_b += g.sum(0).to(grad_b.dtype)
            del g, h
        return (
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
        ) + none


def chunked_token_log_probs(
    hidden: Tensor,
    head: LMHead,
    tokens: Tensor,
    *,
    temperature: float,
    need_entropy: bool,
    chunk_size: int,
    keep: KeepSets | None = None,
) -> tuple[Tensor, Tensor | None]:
    """([N] log-probs of `tokens` [N], [N] entropy or None) from `hidden` [N, H], holding at most `chunk_size`
    positions of [*, V] logits at a time, in the forward and in the backward; over each position's kept set where
    `keep` records one (sampling-mask replay)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    dtype = compute_dtype(hidden, head.weight)
    tokens = tokens.reshape(-1).to(torch.long)
    # autocast off inside: the function casts to `dtype` itself (autocast would also cast its float32 sums)
    with torch.autocast(hidden.device.type, enabled=False):
        logp, entropy = ChunkedTokenLogProbs.apply(
            hidden, head.weight, head.bias, tokens, head.softcap, temperature, need_entropy, chunk_size, dtype, keep
        )
    return logp, (entropy if need_entropy else None)
