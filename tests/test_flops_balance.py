"""--balance-by-flops (slime's flag, lichen.train.flops_balance): Karmarkar-Karp micro-batches by coeff*L + L^2
against a brute-force optimum and against lichen's token-budget first-fit, slime's micro-batch count, the cost
coefficient from config.json, and the planner / rank split wired to it."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from lichen.config import parse_train_args
from lichen.errors import ConfigError
from lichen.train.flops_balance import balanced_micro_batches, flops_coeff, karmarkar_karp, plan_flops, sample_cost
from lichen.train.micro_batches import plan_micro_batches
from lichen.train.step_schedule import split_across_ranks


def _max_bin(bins: list[list[int]], costs: list[float]) -> float:
    return max(sum(costs[i] for i in b) for b in bins)


def _optimum(costs: list[float], k: int) -> float:
    """The smallest possible max bin cost over every assignment of items to k bins (brute force)."""
    best = math.inf
    for assign in itertools.product(range(k), repeat=len(costs)):
        loads = [0.0] * k
        for i, b in enumerate(assign):
            loads[b] += costs[i]
        best = min(best, max(loads))
    return best


def test_crafted_lengths_kk_is_optimal_where_token_first_fit_is_not():
    """Two long samples and many short ones, 4000 tokens, budget 2000 -> 2 micro-batches. First-fit by tokens puts
    both long samples together (their tokens fit the budget), so one micro-batch carries both L^2 terms; the FLOPs
    split pairs each long sample with short ones and reaches the brute-force optimum."""
    coeff = 100.0
    lengths = [1000, 1000] + [250] * 8
    costs = [sample_cost(n, coeff) for n in lengths]
    idx = list(range(len(lengths)))
    ff = [
        [i for row in plan for i in row]
        for plan in plan_micro_batches(idx, lengths, micro_batch_size=1, max_tokens=2000, pack=False)
    ]
    kk = balanced_micro_batches(idx, lengths, 2000, coeff)
    assert len(kk) == len(ff) == 2
    assert sorted(i for b in kk for i in b) == idx
    assert _max_bin(kk, costs) == _optimum(costs, 2) < _max_bin(ff, costs)
    print(f"max micro-batch cost: first-fit {_max_bin(ff, costs):.3g}, flops {_max_bin(kk, costs):.3g}")


@pytest.mark.parametrize("seed", range(40))
def test_karmarkar_karp_against_brute_force(seed):
    """Random small cases: every item once, and a max bin within the largest-differencing method's known worst
    case (4/3 of the optimum); on most cases it is the optimum itself."""
    rng = random.Random(seed)
    k = rng.choice([2, 3])
    lengths = [rng.randint(1, 400) for _ in range(rng.randint(k, 8))]
    costs = [sample_cost(n, 64.0) for n in lengths]
    bins = karmarkar_karp(costs, k)
    assert sorted(i for b in bins for i in b) == list(range(len(costs)))
    assert len(bins) == k
    assert _max_bin(bins, costs) <= 4 / 3 * _optimum(costs, k) + 1e-6


def test_kk_never_worse_than_first_fit_on_ragged_rollouts():
    """W2-like geometric response lengths, 64 samples: split into as many micro-batches as lichen's token budget
    makes, the FLOPs split's largest micro-batch cost is at most first-fit's, over many batches."""
    rng = random.Random(0)
    coeff = 6673.0  # W2's model (flops_coeff of its config)
    ratios = []
    for _ in range(50):
        lengths = [20 + min(256, int(rng.expovariate(1 / 50))) for _ in range(64)]
        idx = list(range(64))
        costs = [sample_cost(n, coeff) for n in lengths]
        ff = plan_micro_batches(idx, lengths, micro_batch_size=1, max_tokens=1024, pack=False)
        ff_bins = [[i for row in p for i in row] for p in ff]
        kk = karmarkar_karp(costs, len(ff_bins))
        ratios.append(_max_bin(kk, costs) / _max_bin(ff_bins, costs))
    print(f"largest micro-batch cost, flops / first-fit: worst {max(ratios):.3f}, mean {sum(ratios) / 50:.3f}")
    assert max(ratios) <= 1.0


def test_slime_micro_batch_count_and_one_sample_each_when_few():
    lengths = [10, 20, 30]
    assert balanced_micro_batches([0, 1, 2], lengths, 25, 1.0) == [[0], [1], [2]]  # ceil(60/25) = 3 >= 3 samples
    assert len(balanced_micro_batches([0, 1, 2], lengths, 40, 1.0)) == 2  # ceil(60/40)
    assert balanced_micro_batches([], lengths, 40, 1.0) == []


def test_coefficient_is_slime_fwd_flops_over_its_quadratic_term():
    """slime's calculate_fwd_flops for a llama-shaped model, written out: a*L + b*L^2 == b * (coeff*L + L^2)."""
    cfg = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 1536,
           "num_hidden_layers": 6, "vocab_size": 1000}  # fmt: skip
    H, h, g, d, F, layers, V = 512, 8, 4, 64, 1536, 6, 1000
    for L in (1, 100, 4096):
        per_layer = 2 * L * H * h * d + 4 * L * H * g * d + 2 * h * L * L * d + 2 * L * H * H + 6 * L * H * F
        slime = layers * per_layer + 2 * L * H * V
        assert sample_cost(L, flops_coeff(cfg)) * layers * 2 * h * d == pytest.approx(slime, rel=1e-12)
    moe = {**cfg, "moe_intermediate_size": 256, "num_experts_per_tok": 2, "shared_expert_intermediate_size": 512}
    assert flops_coeff(moe) < flops_coeff(cfg)  # routed 2 x 256 + shared 512 = 1024 < 1536


def test_planner_and_rank_split_use_the_flops_cost():
    lengths = [1000, 1000] + [250] * 8
    idx = list(range(10))
    plans = plan_micro_batches(idx, lengths, micro_batch_size=1, max_tokens=2000, pack=True, flops_coeff=100.0)
    assert sorted(i for p in plans for row in p for i in row) == idx and len(plans) == 2
    assert all(sum(1 for row in p for i in row if lengths[i] == 1000) == 1 for p in plans)
    # ranks: by plan_flops, not padded tokens (one 1000-token sample outweighs three 300s by FLOPs, not tokens)
    lengths = [1000, 300, 300, 300]
    single = [[[0]], [[1]], [[2]], [[3]]]
    by_flops = split_across_ranks(single, lengths, 2, flops_coeff=100.0)
    assert [[[0]]] == [p for p in by_flops[0] if p is not None]
    assert plan_flops([[1, 2]], lengths, 100.0) == 2 * sample_cost(300, 100.0)


def test_balance_by_flops_needs_dynamic_batch_size(tiny_ckpt, addition_data, tmp_path):
    from helpers.dist_ranks import trainer_argv

    argv = trainer_argv(tiny_ckpt, addition_data, str(tmp_path / "o"), "--balance-by-flops")
    with pytest.raises(ConfigError, match="--balance-by-flops balances the micro-batches of --use-dynamic-batch-size"):
        parse_train_args(argv)
    parse_train_args([*argv, "--use-dynamic-batch-size", "--max-tokens-per-gpu", "64"])
