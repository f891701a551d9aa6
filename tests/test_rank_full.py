"""A full weight version written by every trainer rank (lichen.weights.rank_full, `disk` full under --runtime ray):
the plan splits the bytes evenly and names every file once; one rank writes what the single writer
(save_hf_checkpoint) writes; two gloo FSDP2 ranks gather each tensor into its owner only (no all-gather), each
writes its own files, and together they hold the model; a rank that fails to write makes every rank raise, none
hangs. With real engines under Ray: tests/test_ray_sync_senders.py."""

from __future__ import annotations

import json
import os

import pytest
import torch

from lichen.weights.hf_io import INDEX_FILE, _write_json, load_hf_metadata, load_hf_state_dict, save_hf_checkpoint
from lichen.weights.rank_full import plan_rank_files
from lichen.weights.rank_send import RankSender, engine_nbytes_of, local_gather, tensor_meta
from lichen.weights.wire import tensor_checksum

HEADER = {"format": "pt", "weight_version": "7"}


def meta_of(state: dict[str, torch.Tensor]) -> list[list]:
    return [tensor_meta(n, t) for n, t in state.items()]


def test_the_plan_names_every_tensor_once_and_splits_the_bytes_evenly() -> None:
    g = torch.Generator().manual_seed(0)
    sizes = [7, 300, 40, 40, 300, 5, 1000, 64, 64, 300]
    state = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
    state["steps"] = torch.arange(3)  # integer: keeps its dtype in a bf16 version
    meta = meta_of(state)
    buffer = 1200  # bytes in bf16: 600 elements
    files = plan_rank_files(meta, torch.bfloat16, 2, buffer)
    assert files == plan_rank_files(meta, torch.bfloat16, 2, buffer)  # deterministic: every rank plans the same
    n = len(files)
    assert [f.name for f in files] == [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    assert [f.rank for f in files] == sorted(f.rank for f in files) and {f.rank for f in files} == {0, 1}
    listed = [t for f in files for t in f.tensors]
    assert sorted(listed) == sorted(state)  # every tensor in exactly one file
    order = list(state)
    nbytes = {r[0]: engine_nbytes_of(r[1], r[2], torch.bfloat16) for r in meta}
    for rank in (0, 1):  # a rank's tensors in send order; each file within the buffer unless a tensor alone
        mine = [t for f in files if f.rank == rank for t in f.tensors]
        assert mine == sorted(mine, key=order.index)
    for f in files:
        assert len(f.tensors) == 1 or sum(nbytes[t] for t in f.tensors) <= buffer
    load = [sum(nbytes[t] for f in files if f.rank == r for t in f.tensors) for r in (0, 1)]
    assert abs(load[0] - load[1]) <= max(nbytes.values())  # about model / ranks each
    one = plan_rank_files(meta, torch.bfloat16, 1, buffer)
    assert {f.rank for f in one} == {0} and [t for f in one for t in f.tensors] == order


def test_one_rank_writes_what_the_single_writer_writes(tmp_path) -> None:
    g = torch.Generator().manual_seed(1)
    state = {"a.weight": torch.randn(64, 32, generator=g), "b.bias": torch.randn(200, generator=g)}
    state["steps"] = torch.arange(4, dtype=torch.int64)
    sender = RankSender(0, local_gather(state), lambda: meta_of(state))
    out = tmp_path / "ranks"
    out.mkdir()
    got = sender.write_full(str(out), "bfloat16", 4096, HEADER)
    assert got is not None and got["ranks"] == 1
    assert list(got["weight_map"]) == list(state)  # the index lists the tensors in send order
    assert len(set(got["weight_map"].values())) == 2  # a (4 KiB) alone, then b and steps
    _write_json(
        str(out / INDEX_FILE), {"metadata": {"total_size": got["total_bytes"]}, "weight_map": got["weight_map"]}
    )
    save_hf_checkpoint(state, str(tmp_path / "one"), dtype=torch.bfloat16)
    mine, single = load_hf_state_dict(str(out)), load_hf_state_dict(str(tmp_path / "one"))
    assert mine.keys() == single.keys()
    for name in single:
        assert mine[name].dtype == single[name].dtype and torch.equal(mine[name], single[name]), name
        assert got["sums"][name] == tensor_checksum(single[name]), name
    assert got["total_bytes"] == sum(t.numel() * t.element_size() for t in single.values())
    assert load_hf_metadata(str(out)) == HEADER


def test_a_directory_this_rank_does_not_see_is_named_with_what_to_do(tmp_path) -> None:
    state = {"a.weight": torch.ones(4, 4)}
    sender = RankSender(0, local_gather(state), lambda: meta_of(state))
    with pytest.raises(RuntimeError) as e:
        sender.write_full(str(tmp_path / "elsewhere"), "float32", 4096, HEADER)
    assert "trainer rank 0: FileNotFoundError" in str(e.value) and "--update-weight-disk-dir" in str(e.value)
    assert "shared by every trainer rank's node" in str(e.value)


# ---- two gloo ranks ---------------------------------------------------------------------------------------------
def _module() -> torch.nn.Module:
    """Rows that do not divide by 2 (5 and 1: rank 1's shard of the latter is empty)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 1), torch.nn.Linear(1, 6))


def write_worker(rank: int, world_size: int, port: int, out: str, fail_rank: int) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from lichen.train import fsdp
    from lichen.weights import rank_full

    torch.set_num_threads(1)
    fsdp.init_process_group(rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port, backend="gloo")
    model = _module()
    fully_shard(model)
    full_calls = [0]
    original = DTensor.full_tensor

    def counting(self, *a, **k):
        full_calls[0] += 1
        return original(self, *a, **k)

    sender = RankSender(
        rank,
        lambda ns, dt=None: fsdp.full_tensors(model, ns, dt),
        lambda: [tensor_meta(n, p) for n, p in model.named_parameters()],
        gather_owned=lambda ns, dt, ow, into=None: fsdp.owned_tensors(model, ns, ow, dt, into=into),
    )
    if rank == fail_rank:

        def broken(*a, **k):
            raise OSError("No space left on device")

        rank_full.write_streamed = broken  # type: ignore[assignment]
    record: dict = {}
    DTensor.full_tensor = counting  # type: ignore[method-assign]
    try:
        record["result"] = sender.write_full(out, "bfloat16", 64, HEADER)
    except RuntimeError as e:
        record["error"] = str(e)
    finally:
        DTensor.full_tensor = original  # type: ignore[method-assign]
    record["full_calls"] = full_calls[0]
    torch.save(record, os.path.join(out, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_each_write_the_tensors_they_own(tmp_path) -> None:
    from helpers.dist_ranks import free_port, rank_files, run_ranks

    out = tmp_path / "v"
    out.mkdir()
    run_ranks(write_worker, 2, free_port(), str(out), -1)
    r0, r1 = rank_files(out, 2)
    assert r0["full_calls"] == r1["full_calls"] == 0  # no all-gather: each tensor went into its owner only
    assert r1["result"] is None
    got = r0["result"]
    assert got["ranks"] == 2
    expect = {n: p.detach().to(torch.bfloat16) for n, p in _module().named_parameters()}
    assert list(got["weight_map"]) == list(expect)
    files = plan_rank_files(meta_of(dict(_module().named_parameters())), torch.bfloat16, 2, 64)
    written = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert written == sorted(f.name for f in files) and {f.rank for f in files} == {0, 1}  # both ranks wrote
    _write_json(str(out / INDEX_FILE), {"metadata": {}, "weight_map": got["weight_map"]})
    loaded = load_hf_state_dict(str(out))
    assert loaded.keys() == expect.keys()
    for name, want in expect.items():
        assert torch.equal(loaded[name], want), name
        assert got["sums"][name] == tensor_checksum(want), name
    index = json.loads((out / INDEX_FILE).read_text())
    assert set(index["weight_map"].values()) == set(written)


@pytest.mark.slow
def test_a_rank_that_fails_to_write_makes_every_rank_raise(tmp_path) -> None:
    from helpers.dist_ranks import free_port, rank_files, run_ranks

    out = tmp_path / "v"
    out.mkdir()
    run_ranks(write_worker, 2, free_port(), str(out), 1)  # returns: neither rank hangs in a collective
    r0, r1 = rank_files(out, 2)
    for r in (r0, r1):
        assert "result" not in r
        assert "trainer rank 1: OSError: No space left on device" in r["error"]
