"""Evaluation metrics: mean reward, unbiased pass@k, truncation ratio."""

from __future__ import annotations

from math import comb

from lichen.types import Sample, Status


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt with n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def eval_metrics(groups: list[list[Sample]], reward_key: str | None) -> dict:
    """Metrics over groups of samples of one data set; a sample is correct when its scalar reward is > 0."""
    samples = [s for g in groups for s in g]
    scored = [s for s in samples if s.status != Status.FAILED]
    out = {
        "reward_mean": sum(s.scalar_reward(reward_key) for s in scored) / max(len(scored), 1),
        "truncated_ratio": sum(s.status == Status.TRUNCATED for s in samples) / max(len(samples), 1),
        "response_length_mean": sum(s.response_length for s in samples) / max(len(samples), 1),
        "num_failed": len(samples) - len(scored),
        "num_samples": len(samples),
    }
    n = min(len(g) for g in groups) if groups else 0
    k = 1
    while k <= n:
        vals = []
        for g in groups:
            c = sum(1 for s in g[:n] if s.status != Status.FAILED and s.scalar_reward(reward_key) > 0)
            vals.append(pass_at_k(n, c, k))
        out[f"pass@{k}"] = sum(vals) / len(vals)
        k *= 2
    return out
