"""lichen.cluster.placement: the layout table re-derived from slime's placement rules (slime/ray/placement_group.py:
one group of {"GPU": 1, "CPU": 1} bundles; colocate shares bundles; debug modes drop a side), and the bundle order."""

from __future__ import annotations

import pytest

from lichen.cluster.placement import BundleInfo, Layout, bundle_order, place

# (layout, bundles, trainer ranks' bundles, engines' bundles)
TABLE = [
    # disaggregated: trainer first, engines after it (slime: actor + rollout GPUs, rollout offset = actor GPUs)
    (Layout(1, 2, 2, 1), 4, (0, 1), ((2,), (3,))),
    (Layout(1, 4, 4, 2), 8, (0, 1, 2, 3), ((4, 5), (6, 7))),
    (Layout(2, 8, 8, 4), 24, tuple(range(16)), ((16, 17, 18, 19), (20, 21, 22, 23))),
    # colocated: max(actor, rollout) bundles, both sides from bundle 0
    (Layout(1, 8, 8, 1, colocate=True), 8, tuple(range(8)), tuple((i,) for i in range(8))),
    (Layout(1, 8, 8, 2, colocate=True), 8, tuple(range(8)), ((0, 1), (2, 3), (4, 5), (6, 7))),
    (Layout(1, 4, 2, 1, colocate=True), 4, (0, 1, 2, 3), ((0,), (1,))),
    (Layout(1, 2, 4, 1, colocate=True), 4, (0, 1), ((0,), (1,), (2,), (3,))),
    # debug modes (slime: rollout-only reserves the rollout GPUs only; train-only the actor GPUs only)
    (Layout(1, 4, 2, 1, debug_rollout_only=True), 2, (), ((0,), (1,))),
    (Layout(1, 4, 2, 1, debug_train_only=True), 4, (0, 1, 2, 3), ()),
    # external engines: only the trainer's bundles
    (Layout(1, 2, 2, 1, external_engines=True), 2, (0, 1), ()),
]


@pytest.mark.parametrize("layout,bundles,actor,engines", TABLE)
def test_place_follows_slime_layout(layout, bundles, actor, engines):
    p = place(layout)
    assert (p.num_bundles, p.actor, p.engines) == (bundles, actor, engines)


def test_place_refuses_engines_that_do_not_divide_the_rollout_gpus():
    with pytest.raises(ValueError, match="not a multiple"):
        place(Layout(1, 2, 3, 2))


def test_bundle_order_groups_by_node_then_gpu_and_keys_nodes_by_id_not_ip_alone():
    # Ray numbered the bundles out of order; two raylets share one IP (ray.cluster_utils.Cluster on one host)
    infos = [
        BundleInfo(0, "10.0.0.2", "nodeB", 1),
        BundleInfo(1, "10.0.0.10", "nodeC", 0),
        BundleInfo(2, "10.0.0.2", "nodeA", 1),
        BundleInfo(3, "10.0.0.2", "nodeB", 0),
        BundleInfo(4, "10.0.0.2", "nodeA", 0),
    ]
    order = [(b.node_id, b.gpu_id) for b in bundle_order(infos)]
    # numerically 10.0.0.2 < 10.0.0.10 (a text sort would put .10 first); same IP: by node id, then GPU id
    assert order == [("nodeA", 0), ("nodeA", 1), ("nodeB", 0), ("nodeB", 1), ("nodeC", 0)]
