"""Comparing generations made under different batch schedules (docs/architecture.md#batch-schedules: tokens are
identical only for identical batch schedules). A matmul over 3 rows can round differently than over 64, and on
another CPU kernel family (AVX-512 vs AVX2) differently again, so where two near-tied tokens meet, a sampled token
can flip. These helpers accept rare flips and check everything up to them."""


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where the token lists differ (or where one ends), None if they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def assert_mostly_same_generations(pairs, *, max_flips: int, logprob_tol: float = 1e-5) -> int:
    """pairs: (tokens_a, logprobs_a, tokens_b, logprobs_b) per request. At most `max_flips` requests may diverge;
    every request agrees token for token, and in log-probs within `logprob_tol`, up to its divergence point.
    Returns the number of diverged requests."""
    flips = 0
    for tok_a, lp_a, tok_b, lp_b in pairs:
        cut = first_divergence(list(tok_a), list(tok_b))
        if cut is not None:
            flips += 1
        n = len(tok_a) if cut is None else cut
        assert max((abs(x - y) for x, y in zip(lp_a[:n], lp_b[:n])), default=0.0) <= logprob_tol
    assert flips <= max_flips, f"{flips} of {len(pairs)} generations differ (allowed: {max_flips})"
    return flips
