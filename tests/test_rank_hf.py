"""A multi-rank checkpoint's HF export written by every rank (lichen.weights.rank_hf): the single-process export's
files, each written by one rank, each tensor gathered into that rank only; synchronous and --async-save saves
write the same bytes; a rank that fails makes every rank raise and leaves the previous export in place."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers.dist_ranks import (
    _trainer,
    _vocab,
    async_commit,
    async_save_begin,
    free_port,
    run_ranks,
    save,
    step_batch,
    trainer_argv,
)

from lichen.weights.hf_io import INDEX_FILE, SINGLE_FILE, _shard_name
from lichen.weights.rank_hf import plan_rank_hf, send_order

SMALL_FILES = 64 * 1024  # splits the tiny model into several files


def _layout(sizes: dict[str, int]) -> dict[str, tuple[list[int], torch.dtype]]:
    return {n: ([k], torch.float32) for n, k in sizes.items()}


def test_plan_gives_each_file_to_one_rank_and_interleaves_the_ranks_tensors():
    sizes = {f"t{i}": (i % 7 + 1) * 1000 for i in range(40)}
    names = list(sizes)
    shards = [names[i : i + 5] for i in range(0, 40, 5)]  # 8 files
    plan = plan_rank_hf(shards, _layout(sizes), 3)
    assert [f.name for f in plan.files] == [_shard_name(i, 8) for i in range(8)]
    assert [list(f.tensors) for f in plan.files] == shards
    per_rank = [sum(4 * sizes[n] for f in plan.files if f.rank == r for n in f.tensors) for r in range(3)]
    biggest_file = max(sum(4 * sizes[n] for n in s) for s in shards)
    assert min(per_rank) > 0 and max(per_rank) - min(per_rank) <= biggest_file
    assert sorted(plan.order) == sorted(names)  # every tensor once
    owner = plan.owner()
    for r in range(3):  # each rank receives its tensors in its files' order
        assert [n for n in plan.order if owner[n] == r] == [n for f in plan.files if f.rank == r for n in f.tensors]
    # interleaved: while every rank still has tensors to come, no rank is more than one tensor ahead in bytes
    sent = [0, 0, 0]
    left = [sum(1 for n in names if owner[n] == r) for r in range(3)]
    for n in plan.order:
        r = owner[n]
        if all(left):
            assert sent[r] == min(sent)  # the rank sent the fewest bytes gets the next tensor
        sent[r] += 4 * sizes[n]
        left[r] -= 1
    assert plan == plan_rank_hf(shards, _layout(sizes), 3)  # deterministic
    assert send_order(plan.files, plan.layout, 3) == plan.order


def test_one_file_is_named_as_a_single_file_export_and_written_by_rank_0():
    plan = plan_rank_hf([["a", "b"]], _layout({"a": 10, "b": 20}), 4)
    assert [(f.name, f.rank) for f in plan.files] == [(SINGLE_FILE, 0)]
    assert plan.order == ("a", "b")


def _record_writes(rank: int, out: str, tag: str) -> None:
    """Every safetensors file this rank streams is listed in out/writes-{tag}-{rank}.json."""
    from lichen.weights import rank_full

    real = rank_full.write_streamed
    path = os.path.join(out, f"writes-{tag}-{rank}.json")

    def recorded(file, *a, **k):
        written = json.load(open(path)) if os.path.exists(path) else []
        with open(path, "w") as f:
            json.dump(written + [os.path.relpath(file, out)], f)
        return real(file, *a, **k)

    rank_full.write_streamed = recorded


def _small_files() -> None:
    import lichen.train.dist_trainer as dt
    from lichen.weights import hf_io

    dt.plan_shards = lambda state: hf_io.plan_shards(state, SMALL_FILES)


def sync_async_worker(rank: int, world_size: int, argv: list[str], port: int, out: str) -> None:
    """A synchronous and an --async-save save of the same weights, at a file size that gives each rank files."""
    torch.set_num_threads(1)
    _small_files()
    _record_writes(rank, out, "all")
    t = _trainer(argv, rank, world_size, port)
    t.train(0, step_batch(_vocab(t), 0))
    save(t, os.path.join(out, "sync"), 0)
    async_save_begin(t, os.path.join(out, "async"), 0)
    t.train(1, step_batch(_vocab(t), 1))  # changes the weights in place during the write
    async_commit(t, os.path.join(out, "async"), 0)
    dist.barrier()
    t.close()


def _read_all(d) -> dict[str, bytes]:
    return {f: (d / f).read_bytes() for f in sorted(os.listdir(d))}


@pytest.mark.slow
def test_each_rank_writes_its_files_and_async_writes_the_sync_bytes(tiny_ckpt, addition_data, tmp_path):
    from lichen.train import checkpoint
    from lichen.train.ckpt_integrity import verify

    argv = trainer_argv(tiny_ckpt, addition_data, str(tmp_path / "o"))
    run_ranks(sync_async_worker, 2, argv, free_port(), str(tmp_path))
    hf = {k: checkpoint.iter_dir(str(tmp_path / k), 0) for k in ("sync", "async")}
    a, b = (_read_all(Path(hf[k]) / "hf") for k in ("sync", "async"))
    assert a == b and INDEX_FILE in a
    weights = sorted(f for f in a if f.endswith(".safetensors"))
    assert len(weights) > 3
    writes = [json.load(open(tmp_path / f"writes-all-{r}.json")) for r in range(2)]
    for kind in ("sync", "async"):
        mine = [{os.path.basename(p) for p in w if p.startswith(kind + "/")} for w in writes]
        assert mine[0] and mine[1] and not mine[0] & mine[1], (kind, mine)  # each rank its own files
        assert mine[0] | mine[1] == set(weights), kind
    verify(hf["async"])  # the manifest the ranks' entries made covers every hf/ file
    manifest = json.loads(open(os.path.join(hf["async"], "checksums.json")).read())["files"]
    assert {f"hf/{f}" for f in a} <= set(manifest)


def _record_outcome(t, out: str, write) -> None:
    """Run `write` on this rank; out/result-{rank}.txt says "wrote" or the RuntimeError it raised; then close."""
    try:
        write()
        result = "wrote"
    except RuntimeError as e:
        result = str(e)
    with open(os.path.join(out, f"result-{t.rank}.txt"), "w") as f:
        f.write(result)
    dist.barrier()
    t.close()


def _outcomes(tmp_path) -> list[str]:
    return [(tmp_path / f"result-{r}.txt").read_text() for r in range(2)]


def failing_worker(rank: int, world_size: int, argv: list[str], port: int, out: str) -> None:
    """An export, then another over it in which rank 1's writes fail: both ranks must raise, naming rank 1."""
    from lichen.weights import rank_full

    torch.set_num_threads(1)
    _small_files()
    t = _trainer(argv, rank, world_size, port)
    target = os.path.join(out, "export")
    t._stream_hf(target)
    if rank == 0:
        shutil.copytree(target, os.path.join(out, "first"))
    dist.barrier()
    if rank == 1:

        def broken(*a, **k):
            raise OSError(28, "No space left on device")

        rank_full.write_streamed = broken
    t.train(0, step_batch(_vocab(t), 0))
    _record_outcome(t, out, lambda: t._stream_hf(target))


@pytest.mark.slow
def test_a_failing_rank_makes_every_rank_raise_and_keeps_the_previous_export(tiny_ckpt, addition_data, tmp_path):
    argv = trainer_argv(tiny_ckpt, addition_data, str(tmp_path / "o"))
    run_ranks(failing_worker, 2, argv, free_port(), str(tmp_path))
    results = _outcomes(tmp_path)
    for r in results:
        assert "trainer rank 1" in r and "No space left on device" in r, results
    kept = _read_all(tmp_path / "export")  # the first export, whole: the failed one left no trace
    assert kept == _read_all(tmp_path / "first")
    assert INDEX_FILE in kept and len([f for f in kept if f.endswith(".safetensors")]) > 3
    assert [p for p in os.listdir(tmp_path) if ".tmp-" in p or ".old-" in p] == []


def async_failing_worker(rank: int, world_size: int, argv: list[str], port: int, out: str) -> None:
    """--async-save where rank 1's DCP write fails: the export's exchanges still run, and both ranks' results
    raise, naming rank 1."""
    from lichen.train import rank_ckpt_async

    torch.set_num_threads(1)
    _small_files()
    t = _trainer(argv, rank, world_size, port)
    if rank == 1:

        def failed() -> None:
            raise OSError(122, "Disk quota exceeded")

        rank_ckpt_async._test_hold = failed
    async_save_begin(t, os.path.join(out, "ckpt"), 0)
    _record_outcome(t, out, t.save_done)


@pytest.mark.slow
def test_a_rank_whose_async_write_fails_makes_every_rank_fail_the_export(tiny_ckpt, addition_data, tmp_path):
    from lichen.train import checkpoint

    argv = trainer_argv(tiny_ckpt, addition_data, str(tmp_path / "o"))
    run_ranks(async_failing_worker, 2, argv, free_port(), str(tmp_path))
    results = _outcomes(tmp_path)
    for r in results:
        assert "trainer rank 1" in r and "Disk quota exceeded" in r, results
    d = checkpoint.iter_dir(str(tmp_path / "ckpt"), 0)
    assert not os.path.exists(os.path.join(d, "hf"))  # nothing installed
    assert [p for p in os.listdir(d) if ".tmp-" in p] == []
    assert checkpoint.find_latest(str(tmp_path / "ckpt")) is None
