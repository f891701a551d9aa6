"""The trainer-side weight sender (lichen.weights.rank_send.RankSender): its broadcast overlaps the gather of bucket
k+1 with the transfer of bucket k (checked on the order of events against a recording weight group, and on the
bytes it sends), and FSDP2 ranks gather in the engine dtype (2 ranks in torch.multiprocessing children). End to
end (real engines, real gloo groups, 2 trainer ranks) the same path is covered by tests/test_sync_endpoints.py
and tests/test_ray_sync_senders.py."""

from __future__ import annotations

import os
from typing import Iterator

import pytest
import torch
from helpers.dist_ranks import config, step_batch

from lichen.weights.rank_send import RankSender, tensor_meta
from lichen.weights.wire import flatten_tensors, tensor_checksum

BUCKETS = [["a", "b"], ["c"], ["d", "e"]]


class RecordingGroup:
    """A weight group whose broadcasts are recorded: when each starts and when it is waited for, and the bytes
    it held at the start (a sender that changed them before the wait would show up as a mismatch at the wait)."""

    backend = "gloo"

    def __init__(self, events: list[tuple[str, str]]):
        self.events = events
        self.sent: list[torch.Tensor] = []
        self.count = 0

    def broadcast_async(self, tensor: torch.Tensor):
        self.count += 1
        k, at_start = self.count, tensor.clone()
        self.events.append(("start", f"bucket {k}"))
        events, sent = self.events, self.sent

        class Work:
            def wait(self) -> None:
                assert torch.equal(tensor, at_start), f"bucket {k} changed while on the wire"
                events.append(("wait", f"bucket {k}"))
                sent.append(at_start)

        return Work()


@pytest.fixture
def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(3 + i, 2, generator=g) for i, n in enumerate("abcde")}


def sender_of(weights: dict[str, torch.Tensor], events: list[tuple[str, str]]) -> RankSender:
    def gather(names: list[str], dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for n in names:
            events.append(("gather", n))
            yield n, weights[n].clone()  # a fresh full tensor per gather, as an FSDP2 all-gather gives

    sender = RankSender(0, gather, lambda: [tensor_meta(n, t) for n, t in weights.items()])
    sender.group = RecordingGroup(events)
    return sender


def test_the_next_bucket_is_gathered_while_this_one_is_on_the_wire(weights):
    events: list[tuple[str, str]] = []
    sender = sender_of(weights, events)
    sums: dict[str, str] = {}
    for k, names in enumerate(BUCKETS):  # as lichen.sync.distributed.BroadcastSync.push_from asks
        then = BUCKETS[k + 1] if k + 1 < len(BUCKETS) else None
        sums.update(sender.broadcast(names, "float32", True, then) or {})
    assert events == [
        ("gather", "a"),
        ("gather", "b"),
        ("start", "bucket 1"),
        ("gather", "c"),  # bucket 2 while bucket 1 is in flight
        ("wait", "bucket 1"),
        ("start", "bucket 2"),
        ("gather", "d"),
        ("gather", "e"),
        ("wait", "bucket 2"),
        ("start", "bucket 3"),
        ("wait", "bucket 3"),
    ]
    group = sender.group
    assert [t.tolist() for t in group.sent] == [
        flatten_tensors([weights[n] for n in names]).tolist() for names in BUCKETS
    ]
    assert sums == {n: tensor_checksum(t) for n, t in weights.items()}
    assert sender._ahead is None  # nothing held once the last bucket went


def test_a_bucket_gathered_ahead_for_another_call_is_not_sent(weights):
    """A sync that failed after gathering ahead leaves that bucket behind; the next sync starts at its own first
    bucket, gathers it afresh and sends the current weights."""
    events: list[tuple[str, str]] = []
    sender = sender_of(weights, events)
    sender.broadcast(BUCKETS[0], "float32", True, BUCKETS[1])  # the failed sync stopped here, bucket 2 gathered
    weights["c"] += 1.0  # the next step changed it
    events.clear()
    sums = sender.broadcast(BUCKETS[1], "bfloat16", True, None)  # same names, another engine dtype: not reused
    assert events[0] == ("gather", "c")
    assert sums == {"c": tensor_checksum(weights["c"].to(torch.bfloat16))}
    assert torch.equal(sender.group.sent[-1], flatten_tensors([weights["c"].to(torch.bfloat16)]))


def test_the_broadcast_in_flight_is_waited_for_when_the_next_gather_fails(weights):
    events: list[tuple[str, str]] = []
    sender = sender_of(weights, events)
    with pytest.raises(KeyError):
        sender.broadcast(BUCKETS[0], "float32", True, ["no-such-tensor"])
    assert events[-1] == ("wait", "bucket 1")
    assert sender._ahead is None


def test_a_sync_reuses_the_memory_of_buckets_already_sent():
    """A CPU bucket's memory takes a later bucket of the same sync once nobody reads it (broadcast: after its wait;
    tensor: once the driver asks for the next bucket, every engine having answered), never while it is read (the
    recording group checks that a bucket did not change on the wire); nothing is kept after the last bucket."""
    g = torch.Generator().manual_seed(1)
    weights = {n: torch.randn(4, 3, generator=g) for n in "abcd"}
    events: list[tuple[str, str]] = []
    sender = sender_of(weights, events)
    group = sender.group
    ptrs: list[int] = []
    start = group.broadcast_async
    group.broadcast_async = lambda t: (ptrs.append(t.data_ptr()), start(t))[1]
    buckets = [["a"], ["b"], ["c"], ["d"]]
    for k, names in enumerate(buckets):
        sender.broadcast(names, "float32", True, buckets[k + 1] if k + 1 < len(buckets) else None)
    # bucket 2 is gathered while bucket 1 is on the wire (two allocations); 3 and 4 take their memory in turn
    assert ptrs[2] == ptrs[0] and ptrs[3] == ptrs[1] and ptrs[0] != ptrs[1]
    assert [t.tolist() for t in group.sent] == [flatten_tensors([weights[n]]).tolist() for n in "abcd"]
    assert len(sender._pool) == 0

    held: list[tuple[int, list[float]]] = []
    for names in buckets:
        out = sender.tensor_bucket(names, "float32", 1)
        flat, views = sender._held
        assert flat.untyped_storage().is_shared()  # in /dev/shm, where an engine maps it
        held.append((flat.data_ptr(), views[0][1].flatten().tolist()))
        assert out["sums"] == {names[0]: tensor_checksum(weights[names[0]])}
    assert len({p for p, _ in held}) == 1  # one allocation for the whole sync
    assert [v for _, v in held] == [weights[n].flatten().tolist() for n in "abcd"]
    sender.tensor_release()
    assert sender._held is None and len(sender._pool) == 0


def test_the_bucket_pool_reuses_by_kind_and_size():
    from lichen.weights.shm_buckets import BucketPool, shm_empty

    pool = BucketPool(keep=2)
    shared, private = shm_empty(100), torch.empty(100, dtype=torch.uint8)
    assert shared.untyped_storage().is_shared() and not private.untyped_storage().is_shared()
    pool.give(shared[:60])  # a view: the whole allocation is kept
    pool.give(private)
    assert pool.reuse(101, shared=True) is None
    got = pool.reuse(80, shared=True)
    assert got is not None and got.data_ptr() == shared.data_ptr() and got.numel() == 80
    assert pool.reuse(10, shared=True) is None  # taken
    assert pool.reuse(10, shared=False).data_ptr() == private.data_ptr()
    for n in (10, 30, 20):
        pool.give(torch.empty(n, dtype=torch.uint8))
    assert len(pool) == 2 and pool.reuse(25, shared=False).numel() == 25  # the largest two were kept
    pool.clear()
    assert len(pool) == 0


def cast_gather_worker(rank: int, world_size: int, argv: list[str], port: int, out: str) -> None:
    """After a step: what rank 0 sends for a bf16 engine (the `rows` op, whole tensors), the dtypes of the shards
    the gathers moved (and whether any all-gather ran), and the gathered state for comparison."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from lichen.train.dist_trainer import DistTrainer

    torch.set_num_threads(1)
    cfg, args = config(argv)
    t = DistTrainer(cfg, args, rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port)
    t.train(0, step_batch(t.model.cfg.vocab_size, 0))
    moved: list[list[int]] = []  # each exchange's bytes sent to each rank
    all_gathers = [0]
    exchange, full_tensor = dist.all_to_all_single, DTensor.full_tensor

    def recording(output, input, output_split_sizes, input_split_sizes, **k):
        moved.append(list(input_split_sizes))
        return exchange(output, input, output_split_sizes, input_split_sizes, **k)

    def counting(self, *a, **k):
        all_gathers[0] += 1
        return full_tensor(self, *a, **k)

    dist.all_to_all_single, DTensor.full_tensor = recording, counting  # type: ignore[method-assign]
    try:
        names = [row[0] for row in t.sync_weights("meta")]
        sent = t.sync_weights("rows", names, "bfloat16", None)
    finally:
        dist.all_to_all_single, DTensor.full_tensor = exchange, full_tensor  # type: ignore[method-assign]
    whole = t.full_state_dict()
    record = {"sent": sent, "moved": moved, "all_gathers": all_gathers[0], "whole": whole}
    torch.save(record, os.path.join(out, f"rank{rank}.pt"))
    t.close()


@pytest.mark.slow
def test_ranks_gather_in_the_engine_dtype_and_send_the_same_bits(tiny_ckpt, addition_data, tmp_path):
    """A bf16 engine's sync: the ranks cast their fp32 shards before exchanging them into rank 0 (half the bytes on
    the wire, and no all-gather: the other ranks receive nothing) and rank 0 sends exactly the gathered fp32
    weights cast to bf16."""
    from helpers.dist_ranks import free_port, rank_files, run_ranks, trainer_argv

    argv = trainer_argv(tiny_ckpt, addition_data, str(tmp_path / "o"))
    config(argv)
    run_ranks(cast_gather_worker, 2, argv, free_port(), str(tmp_path))
    r0, r1 = rank_files(tmp_path, 2)
    whole = r0["whole"]
    assert r0["sent"].keys() == whole.keys() and r1["sent"] is None
    for name, w in whole.items():
        assert w.dtype == torch.float32
        assert r0["sent"][name].dtype == torch.bfloat16 and torch.equal(r0["sent"][name], w.to(torch.bfloat16)), name
    # rank 1's exchanges sent its bf16 shards (padded to ceil(rows / 2) rows) to rank 0 only; rank 0's own shards
    # never entered an exchange (it sent nothing); no all-gather ran
    bf16_shards = sum(-(-w.shape[0] // 2) * (w.numel() // w.shape[0]) * 2 for w in whole.values())
    assert r1["moved"] and all(split[1] == 0 for split in r1["moved"])
    assert sum(split[0] for split in r1["moved"]) == bf16_shards
    assert len(r0["moved"]) == len(r1["moved"]) and all(split == [0, 0] for split in r0["moved"])
    assert r0["all_gathers"] == r1["all_gathers"] == 0


def tensor_bucket_worker(rank: int, world_size: int, argv: list[str], port: int, out: str) -> None:
    """The `tensor` transport's bucket op for one engine TP rank, then for two, with the ranks sharing rank 0's
    memory (they do here: one host) and with that turned off: the checksums rank 0 returns, each rank's handles,
    how many all-gathers and all-to-alls ran, and what each rank wrote into the shared bucket."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from lichen.train import fsdp
    from lichen.train.dist_trainer import DistTrainer

    torch.set_num_threads(1)
    cfg, args = config(argv)
    t = DistTrainer(cfg, args, rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port)
    t.train(0, step_batch(t.model.cfg.vocab_size, 0))
    names = [row[0] for row in t.sync_weights("meta")]
    full_tensor, all_to_all, record = DTensor.full_tensor, dist.all_to_all_single, {}
    write_rows, wrote = fsdp.write_local_rows, [0]

    def counting_writes(model, names, views):
        before = [v.clone() for v in views]
        write_rows(model, names, views)
        wrote[0] += sum(int((v != b).sum()) for v, b in zip(views, before))

    fsdp.write_local_rows = counting_writes
    for shared in (True, False):
        t._weight_sender._shares_shm = None if shared else False
        for entries in (1, 2):
            counts = {"all_gathers": 0, "all_to_alls": 0}
            wrote[0] = 0

            def counting(self, *a, **k):
                counts["all_gathers"] += 1
                return full_tensor(self, *a, **k)

            def counting_a2a(*a, **k):
                counts["all_to_alls"] += 1
                return all_to_all(*a, **k)

            DTensor.full_tensor = counting  # type: ignore[method-assign]
            dist.all_to_all_single = counting_a2a
            try:
                got = t.sync_weights("tensor_bucket", names, "float32", entries)
            finally:
                DTensor.full_tensor = full_tensor  # type: ignore[method-assign]
                dist.all_to_all_single = all_to_all
            record[(shared, entries)] = {"got": got, **counts, "wrote": wrote[0]}
            t.sync_weights("tensor_release")
        record[("probed", shared)] = t._weight_sender._shares_shm
    from lichen.weights import rank_shm

    if rank == 1:  # a rank that cannot map rank 0's memory (another host, another /dev/shm): every rank says so

        def elsewhere(handle):
            raise FileNotFoundError("/dev/shm/torch_x")

        rank_shm.open_bucket = elsewhere
    t._weight_sender._shares_shm = None
    record["probe_elsewhere"] = t._weight_sender._host_shared()
    params = dict(t.model.named_parameters())
    record["sharded"] = sum(isinstance(params[n], DTensor) for n in names)  # one all-gather each, in an all-gather
    record["whole"] = t.full_state_dict()
    torch.save(record, os.path.join(out, f"rank{rank}.pt"))
    t.close()


@pytest.mark.slow
def test_a_tensor_bucket_is_written_by_every_rank_or_gathered_where_ranks_share_no_memory(
    tiny_ckpt, addition_data, tmp_path
):
    """`tensor` on one host: every rank writes its own rows into rank 0's shared bucket (no all-gather, no
    all-to-all, both ranks write a part), rank 0 answers a handle per engine TP rank and the checksums of the
    trainer's whole tensors. Where the ranks share no memory: with one engine TP rank rank 0 serves it alone, so
    the bucket is exchanged into rank 0 (no all-gather: rank 1 receives nothing); with two both ranks serve one,
    and each gathers the whole bucket."""
    from helpers.dist_ranks import free_port, rank_files, run_ranks, trainer_argv

    from lichen.weights.wire import tensor_checksum

    argv = trainer_argv(tiny_ckpt, addition_data, str(tmp_path / "o"))
    config(argv)
    run_ranks(tensor_bucket_worker, 2, argv, free_port(), str(tmp_path))
    r0, r1 = rank_files(tmp_path, 2)
    want = {name: tensor_checksum(w) for name, w in r0["whole"].items()}
    assert r0[("probed", True)] is r1[("probed", True)] is True  # one host: the ranks map rank 0's memory
    assert r0["probe_elsewhere"] is r1["probe_elsewhere"] is False
    for shared in (True, False):
        for entries in (1, 2):
            got = r0[(shared, entries)]["got"]
            assert r1[(shared, entries)]["got"] is None and got["sums"] == want and len(got["handles"]) == entries
    assert r0["sharded"] == r1["sharded"] > 0
    for entries in (1, 2):  # shared: nothing gathered or exchanged, both ranks wrote rows
        for r in (r0, r1):
            assert r[(True, entries)]["all_gathers"] == r[(True, entries)]["all_to_alls"] == 0
            assert r[(True, entries)]["wrote"] > 0
    assert r0[(False, 1)]["all_gathers"] == r1[(False, 1)]["all_gathers"] == 0
    assert r0[(False, 1)]["all_to_alls"] > 0
    assert r0[(False, 2)]["all_gathers"] == r1[(False, 2)]["all_gathers"] == r0["sharded"]


def shared_fill_worker(rank: int, world_size: int, argv: list[str], port: int, out: str) -> None:
    """A broadcast bucket filled with the ranks writing their rows into rank 0's shared memory, then gathered with
    that turned off: rank 0's bucket bytes and checksums each way, and the all-to-alls each ran."""
    import torch.distributed as dist

    from lichen.train.dist_trainer import DistTrainer

    torch.set_num_threads(1)
    cfg, args = config(argv)
    t = DistTrainer(cfg, args, rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port)
    t.train(0, step_batch(t.model.cfg.vocab_size, 0))
    names = [row[0] for row in t.sync_weights("meta")]
    sender, exchange, record = t._weight_sender, dist.all_to_all_single, {}
    for shared in (True, False):
        sender._shares_shm = None if shared else False
        a2a = [0]

        def counting(*a, **k):
            a2a[0] += 1
            return exchange(*a, **k)

        dist.all_to_all_single = counting
        try:
            flat, sums = sender._fill(names, torch.bfloat16)
        finally:
            dist.all_to_all_single = exchange
        record[shared] = {"flat": None if flat is None else flat.clone(), "sums": sums, "all_to_alls": a2a[0]}
    torch.save(record, os.path.join(out, f"rank{rank}.pt"))
    t.close()


@pytest.mark.slow
def test_a_broadcast_bucket_written_in_shared_memory_holds_the_gathered_bytes(tiny_ckpt, addition_data, tmp_path):
    """CPU ranks on one host fill a broadcast bucket by writing their own rows into rank 0's shared memory (no
    all-to-all); the bucket's bytes and checksums are those the gather into rank 0 builds."""
    from helpers.dist_ranks import free_port, rank_files, run_ranks, trainer_argv

    argv = trainer_argv(tiny_ckpt, addition_data, str(tmp_path / "o"))
    config(argv)
    run_ranks(shared_fill_worker, 2, argv, free_port(), str(tmp_path))
    r0, r1 = rank_files(tmp_path, 2)
    assert torch.equal(r0[True]["flat"], r0[False]["flat"]) and r0[True]["sums"] == r0[False]["sums"]
    assert len(r0[True]["sums"]) > 10 and r1[True]["flat"] is None and r1[True]["sums"] == {}
    assert r0[True]["all_to_alls"] == r1[True]["all_to_alls"] == 0
    assert r0[False]["all_to_alls"] == r1[False]["all_to_alls"] > 0
