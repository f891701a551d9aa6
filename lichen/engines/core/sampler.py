"""Per-sample seeded sampling, vectorized over the batch.

Each sample carries its own 32-bit seed (docs/architecture.md#sampling-seeds). The random number for (seed, step,
token) comes from a
counter-based hash rather than a stateful generator, so a sample's draws do not depend on which other samples
share its batch, on the engine it was routed to, or on retries — and the whole batch is sampled in a few
tensor ops on any device.

Sampling uses the exponential race: with E_i ~ Exp(1) i.i.d., argmax_i p_i / E_i is distributed as p, i.e.
token = argmax_i (log p_i - log E_i) with E_i = -log U_i. Top-p / top-k remove tokens from the race (log p = -inf);
the returned log-prob is read from the untruncated log_softmax(logits / T) (docs/architecture.md#log-prob-convention),
except for a request that asks for its sampling mask (`kept_sets`): then the engine returns, per position, the
sorted ids the race kept and the log-prob renormalized over them, the distribution the token was drawn from.
"""

from __future__ import annotations

import hashlib

import torch

_M32 = 0xFFFFFFFF


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2^32 for 0 <= h < 2^32 held in int64, without overflowing int64."""
    lo = (h & 0xFFFF) * c
    hi = ((h >> 16) * c) & 0xFFFF
    return (lo + (hi << 16)) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer: a bijection on [0, 2^32) with good avalanche."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def row_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """U[b, v] in (0, 1), a pure function of (seeds[b], steps[b], v): the one sampling-noise hash.

    Rows of a continuous batch are at different steps; a sample draws the same numbers whether it decodes alone,
    in a batch or after a retry.
    """
    device = seeds.device
    step_key = _fmix32((_mul32(steps.to(torch.int64) & _M32, 0x9E3779B9) + 0x632BE5AB) & _M32)  # [B]
    base = _fmix32((seeds.to(torch.int64) & _M32) ^ step_key)  # [B]
    cols = _mul32(torch.arange(vocab_size, dtype=torch.int64, device=device), 0x27D4EB2F)  # [V]
    h = _fmix32(_fmix32(base[:, None] ^ cols[None, :]) ^ base[:, None])
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def derive_seed(*parts: int) -> int:
    """A 32-bit seed from integers, e.g. (--seed, rollout_id, prompt_index, sample_index)."""
    data = ",".join(str(int(p)) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=4).digest(), "little")


def truncate_logprobs(logp: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Set log-probs outside each row's top-k / top-p nucleus to -inf (top_k <= 0 or top_p >= 1 disable)."""
    sorted_lp, order = torch.sort(logp, dim=-1, descending=True)
    ranks = torch.arange(logp.shape[-1], device=logp.device)[None, :]
    # A token is kept if the probability mass strictly before it is < top_p (so the first is always kept).
    mass_before = torch.cumsum(sorted_lp.exp(), dim=-1) - sorted_lp.exp()
    drop = mass_before >= top_p[:, None]
    drop |= (top_k[:, None] > 0) & (ranks >= top_k[:, None])
    sorted_lp = sorted_lp.masked_fill(drop, float("-inf"))
    return torch.empty_like(logp).scatter_(-1, order, sorted_lp)


def truncates(top_p: float, top_k: int) -> bool:
    """Whether top-p / top-k remove tokens from the race (then a request may ask for its sampling mask)."""
    return top_p < 1.0 or top_k > 0


def kept_sets(
    logp: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, tokens: torch.Tensor
) -> tuple[list[list[int]], list[float]]:
    """Per row of `logp` [B, V] (log_softmax(logits / T)): the sorted token ids that top-p / top-k keep (the race's
    candidates, `truncate_logprobs`) and the log-prob of `tokens[b]` renormalized over that set. The same function
    of the same tensor as the race, so the set is exactly the one the token was sampled from."""
    kept_lp = truncate_logprobs(logp, top_p, top_k)
    renorm = torch.log_softmax(kept_lp, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    ids = [torch.isfinite(row).nonzero().squeeze(-1).tolist() for row in kept_lp]
    return ids, renorm.tolist()


def sample_with_noise(logits, temperature, top_p, top_k, noise) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exponential race given `noise(vocab_size) -> U [B, V]`. Returns (tokens, log-probs, logp [B, V])."""
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    logp = torch.log_softmax(logits.float() / t[:, None], dim=-1)
    race_lp = logp
    if bool(((top_p < 1.0) | (top_k > 0)).any()):
        race_lp = truncate_logprobs(logp, top_p, top_k)
    if bool(greedy.all()):
        tokens = logits.argmax(dim=-1)
    else:
        score = race_lp - torch.log(-torch.log(noise(logits.shape[-1])))
        tokens = torch.where(greedy, logits.argmax(dim=-1), score.argmax(dim=-1))
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1), logp


def sample_rows(logits, temperature, top_p, top_k, seeds, steps) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one token per row, row b at its own step `steps[b]`. Returns (tokens [B], log-probs [B], logp [B, V])
    where logp = log_softmax(logits / T) over the full vocabulary. Rows with temperature <= 0 are greedy (argmax);
    their log-prob is read at T = 1."""
    return sample_with_noise(logits, temperature, top_p, top_k, lambda v: row_noise(seeds, steps, v))
