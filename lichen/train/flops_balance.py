"""--balance-by-flops (slime's flag): micro-batches that balance estimated forward FLOPs instead of tokens.

slime (slime/utils/dp_schedule.py, PRs #2017 and #2029) splits a step's samples into
ceil(total tokens / --max-tokens-per-gpu) micro-batches with the Karmarkar-Karp largest-differencing method over
each sample's forward FLOPs (slime/utils/flops_utils.calculate_fwd_flops), and no longer caps a micro-batch's
tokens. That estimate is a*L + b*L^2 for a sample of L tokens: the projections, MLP and LM head are linear in L,
attention scores and their product with V quadratic. Dividing by b gives slime's documented form coeff*L + L^2,
which partitions identically (`sample_cost`), with coeff from the model's config.json (`flops_coeff`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping


def flops_coeff(config: Mapping) -> float:
    """The linear coefficient of a sample's forward cost coeff*L + L^2, from a Hugging Face config.json.

    The terms are those of slime's calculate_fwd_flops for a non-MLA model, per layer: Q projection 2*H*h*d, K and
    V 4*H*g*d, output 2*H*H, gated MLP 6*H*F (F: the dense width, or for MoE the routed experts' width times top-k
    plus the shared experts'); once: the LM head 2*H*V; quadratic: attention 2*h*d*L^2 per layer. Every layer is
    counted as MoE when the config names experts (slime: its --moe-layer-freq decides; lichen does not read it).
    """
    text = config.get("text_config", config)  # multimodal configs nest the language model's
    H = int(text["hidden_size"])
    h = int(text["num_attention_heads"])
    g = int(text.get("num_key_value_heads") or h)
    d = int(text.get("head_dim") or H // h)
    layers = int(text["num_hidden_layers"])
    V = int(text["vocab_size"])
    F = int(text.get("intermediate_size") or 4 * H)
    routed = text.get("moe_intermediate_size")
    top_k = text.get("num_experts_per_tok")
    if routed and top_k:
        shared = text.get("shared_expert_intermediate_size")
        if shared is None:
            shared = int(routed) * int(text.get("n_shared_experts") or 0)
        F = int(routed) * int(top_k) + int(shared)
    linear = layers * (2 * H * h * d + 4 * H * g * d + 2 * H * H + 6 * H * F) + 2 * H * V
    return linear / (layers * 2 * h * d)


def sample_cost(length: int, coeff: float) -> float:
    """The forward cost of one sample of `length` tokens in units of its attention's L^2 term."""
    return coeff * length + length * length


def karmarkar_karp(costs: list[float], k: int) -> list[list[int]]:
    """`range(len(costs))` split into `k` parts of near-equal cost sum (the largest differencing method).

    Every item starts as a k-tuple of parts (itself and k-1 empty ones). The two tuples whose largest and smallest
    part differ most are merged, largest part with smallest, until one tuple is left: its parts. Ties break on
    item order, so the answer is a pure function of `costs`. Parts come back largest sum first; a part may be
    empty only when there are fewer than k items.
    """
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    for i, c in enumerate(costs):
        parts = [(float(c), [i])] + [(0.0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-float(c), i, parts))  # spread of a single item: its own cost
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        _, tie, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
        merged.sort(key=lambda part: -part[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
    return [sorted(items) for _, items in heap[0][2]]


def balanced_micro_batches(indices: list[int], lengths: list[int], max_tokens: int, coeff: float) -> list[list[int]]:
    """slime's --balance-by-flops split of `indices`: ceil(their tokens / max_tokens) micro-batches (one sample
    each when that is at least their count), balanced by `sample_cost` with karmarkar_karp. A micro-batch may
    hold more than `max_tokens` tokens, as in slime. Each micro-batch keeps the order of `indices`."""
    if not indices:
        return []
    total = sum(lengths[i] for i in indices)
    count = max(1, math.ceil(total / max_tokens))
    if count >= len(indices):
        return [[i] for i in indices]
    parts = karmarkar_karp([sample_cost(lengths[i], coeff) for i in indices], count)
    return [[indices[j] for j in part] for part in parts if part]


def plan_flops(plan: list[list[int]], lengths: list[int], coeff: float) -> float:
    """The estimated cost of a micro-batch: the sum of its samples' sample_cost (slime's per-sample estimate; a
    packed row's attention runs sample by sample, lichen.models.packed_attention, so it costs its samples' L^2)."""
    return sum(sample_cost(lengths[i], coeff) for row in plan for i in row)
