"""A rank's part of a `disk` delta version (lichen.weights.rank_delta), in one process: what one rank writes is
byte for byte what the single publisher (lichen.weights.versions.VersionPublisher) writes for the same weights, and
a delta the rank holds no base for is refused; two gloo ranks gather each tensor into its owner and together write
what the single publisher writes. The 2-rank path with engines runs under Ray in tests/test_ray_sync_senders.py."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from lichen.weights.rank_owners import owner_partition
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


# ---- two gloo ranks: each tensor is gathered into its owner only --------------------------------------------
def _module(step: int) -> torch.nn.Module:
    """Rows that do not divide by 2 (5 and 1: rank 1's shard of the latter is empty); a few entries move per step."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 1))
    with torch.no_grad():
        m[0].weight[: step + 1] += 0.25 * step
        m[1].bias += step
    return m


def owned_worker(rank: int, world_size: int, port: int, out: str) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from lichen.train import fsdp

    torch.set_num_threads(1)
    fsdp.init_process_group(rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port, backend="gloo")
    names = [n for n, _ in _module(0).named_parameters()]
    owner = {n: i % world_size for i, n in enumerate(names)}
    full_calls = [0]
    original = DTensor.full_tensor

    def counting(self, *a, **k):
        full_calls[0] += 1
        return original(self, *a, **k)

    record: dict = {"owned": {}, "full": {}, "parts": {}}
    for step in (1, 2):
        model = _module(step)
        fully_shard(model)
        if step == 1:
            for dtype in (None, torch.bfloat16):
                DTensor.full_tensor = counting  # type: ignore[method-assign]
                try:
                    record["owned"][str(dtype)] = dict(fsdp.owned_tensors(model, names, owner, dtype))
                finally:
                    DTensor.full_tensor = original  # type: ignore[method-assign]
                record["full"][str(dtype)] = dict(fsdp.full_tensors(model, names, dtype))
                # one exchange per tensor instead of one for the four
                record.setdefault("each", {})[str(dtype)] = dict(fsdp.owned_tensors(model, names, owner, dtype, 1))
            # built in the caller's buffers (a broadcast bucket's slices): the first tensor of each rank's
            # not (into gives None)
            bufs = {n: torch.full(p.shape, float("nan")) for n, p in _module(0).named_parameters()}
            firsts = {min((n for n in names if owner[n] == r), key=names.index) for r in range(world_size)}
            into = {n: b for n, b in bufs.items() if n not in firsts}.get
            record["into"] = {
                n: (t.data_ptr() == bufs[n].data_ptr(), t.clone())
                for n, t in fsdp.owned_tensors(model, names, owner, into=into)
                if t is not None
            }
            record["full_calls"] = full_calls[0]
            sender = RankSender(
                rank,
                lambda ns, dt=None, m=model: fsdp.full_tensors(m, ns, dt),
                lambda m=model: [tensor_meta(n, p) for n, p in m.named_parameters()],
                gather_owned=lambda ns, dt, ow, into=None, m=model: fsdp.owned_tensors(m, ns, ow, dt, into=into),
            )
        else:  # the same sender (its snapshot) over the next step's weights
            sender._gather_owned = lambda ns, dt, ow, into=None, m=model: fsdp.owned_tensors(m, ns, ow, dt, into=into)
        part_dir = os.path.join(out, f"part{step}")
        os.makedirs(part_dir, exist_ok=True)
        kind = "full" if step == 1 else "delta"
        record["parts"][step] = sender.delta_part(part_dir, kind, step, "chain", "bfloat16", "xor", "xxh3-128")
        torch.distributed.barrier()
    torch.save(record, os.path.join(out, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_gather_each_tensor_into_its_owner_and_publish_what_one_publisher_does(tmp_path) -> None:
    from helpers.dist_ranks import free_port, rank_files, run_ranks

    run_ranks(owned_worker, 2, free_port(), str(tmp_path))
    r0, r1 = rank_files(tmp_path, 2)
    expect = dict(_module(1).named_parameters())
    owner = {n: i % 2 for i, n in enumerate(expect)}
    for dtype, cast in (("None", torch.float32), ("torch.bfloat16", torch.bfloat16)):
        for name, want in expect.items():
            mine, other = (r0, r1) if owner[name] == 0 else (r1, r0)
            got = mine["owned"][dtype][name]
            assert other["owned"][dtype][name] is None, name
            assert got.dtype == cast and got.shape == want.shape, name
            assert torch.equal(got, want.detach().to(cast)), name
            assert torch.equal(got, mine["full"][dtype][name]), name  # what the all-gather gives
            assert torch.equal(got, mine["each"][dtype][name]) and other["each"][dtype][name] is None, name
    assert r0["full_calls"] == r1["full_calls"] == 0  # no all-gather: every tensor went into its owner only
    for r, rank in ((r0, 0), (r1, 1)):  # built in the buffer `into` gave, or a new one where it gave none
        mine = [n for n in expect if owner[n] == rank]
        assert r["into"].keys() == set(mine)
        for name in mine:
            in_place, got = r["into"][name]
            assert in_place == (name != mine[0]) and torch.equal(got, expect[name].detach()), name

    # the two ranks' files of each version hold what the single publisher writes for the same weights
    pub = VersionPublisher(str(tmp_path / "pub"), dtype=torch.bfloat16, encoding="xor")
    for step in (1, 2):
        res = pub.publish({n: p.detach() for n, p in _module(step).named_parameters()}, step)
        assert res.kind == ("full" if step == 1 else "delta") and r1["parts"][step] is None
        part = r0["parts"][step]
        assert part["ranks"] == 2 and part["published"] == res.num_published
        index = json.loads(open(os.path.join(res.path, "model.safetensors.index.json")).read())
        assert part["weight_map"].keys() == index["weight_map"].keys()
        by_ranks: dict = {}
        by_publisher: dict = {}
        for fname in set(part["weight_map"].values()):
            meta, tensors = shard(str(tmp_path / f"part{step}" / fname))
            by_ranks.update({n: (meta[n], b) for n, b in tensors.items()})
        for fname in set(index["weight_map"].values()):
            meta, tensors = shard(os.path.join(res.path, fname))
            by_publisher.update({n: (meta[n], b) for n, b in tensors.items()})
        assert by_ranks == by_publisher  # each tensor's checksum and bytes (a delta: its zstd payload)
    assert len({v for v in r0["parts"][1]["weight_map"].values()}) == 2  # both ranks wrote a file
