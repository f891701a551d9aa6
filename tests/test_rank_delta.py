"""A rank's part of a `disk` delta version (lichen.weights.rank_delta), in one process: what one rank writes is
byte for byte what the single publisher (lichen.weights.versions.VersionPublisher) writes for the same weights, and
a delta the rank holds no base for is refused. The 2-rank path runs under Ray in tests/test_ray_sync_senders.py."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from lichen.weights.rank_delta import owner_partition
from lichen.weights.rank_send import RankSender, local_gather, tensor_meta
from lichen.weights.versions import VersionPublisher


def weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = {"a.weight": torch.randn(64, 32, generator=g), "b.weight": torch.randn(200, generator=g)}
    base["steps"] = torch.arange(4, dtype=torch.int64)
    out = {k: v.clone() for k, v in base.items()}
    out["a.weight"][: step * 3] += 0.01 * step  # a few rows move per step; b only at step 2
    if step == 2:
        out["b.weight"][5] = 7.0
    return out


def shard(path: str) -> tuple[dict, dict]:
    """A safetensors file's metadata and each tensor's raw bytes (safetensors orders the header's metadata as a
    hash map does, so files with the same content need not be byte-identical)."""
    with safe_open(path, "pt") as f:
        return f.metadata(), {n: f.get_tensor(n).reshape(-1).view(torch.uint8).numpy().tobytes() for n in f.keys()}


def sender_over(state: dict[str, torch.Tensor]) -> RankSender:
    return RankSender(0, local_gather(state), lambda: [tensor_meta(n, t) for n, t in state.items()])


def test_one_rank_writes_what_the_single_publisher_writes(tmp_path) -> None:
    state: dict[str, torch.Tensor] = {}
    sender = sender_over(state)
    pub = VersionPublisher(str(tmp_path / "pub"), dtype=torch.bfloat16, encoding="xor")
    for v in (1, 2, 3):
        state.clear()
        state.update(weights(v))
        res = pub.publish(state, v)
        part_dir = tmp_path / f"part{v}"
        part_dir.mkdir()
        kind = "full" if v == 1 else "delta"
        part = sender.delta_part(str(part_dir), kind, v, "chain", "bfloat16", "xor", "xxh3-128")
        assert res.kind == kind and part is not None
        index = json.loads(open(os.path.join(res.path, "model.safetensors.index.json")).read())
        assert part["weight_map"] == index["weight_map"] and part["published"] == res.num_published
        for fname in set(index["weight_map"].values()):  # the same shards: tensors (payloads) and checksums
            assert shard(str(part_dir / fname)) == shard(os.path.join(res.path, fname))
    assert part["changed_bytes"] == res.changed_bytes


def test_a_delta_without_its_base_is_refused(tmp_path) -> None:
    state = weights(1)
    sender = sender_over(state)
    args = ("bfloat16", "xor", "xxh3-128")
    sender.delta_part(str(tmp_path), "full", 1, "chain-a", *args)
    with pytest.raises(RuntimeError, match=r"trainer rank 0: .*snapshot of version 2 of chain chain-a"):
        sender.delta_part(str(tmp_path), "delta", 3, "chain-a", *args)  # skips version 2
    with pytest.raises(RuntimeError, match="needs this rank's snapshot"):  # the failure forgot the snapshot
        sender.delta_part(str(tmp_path), "delta", 2, "chain-a", *args)


def test_owner_partition_balances_bytes_deterministically() -> None:
    sizes = [("a", 4), ("b", 3), ("c", 2), ("d", 1)]
    assert owner_partition(sizes, 2) == {"a": 0, "b": 1, "c": 1, "d": 0}
    assert owner_partition(sizes, 1) == dict.fromkeys("abcd", 0)
