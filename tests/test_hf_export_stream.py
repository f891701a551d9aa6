"""The multi-rank trainer's HF export streams (issue 27 item 3): rank 0 writes each safetensors file tensor by tensor
as the ranks send it their shards (lichen.weights.safetensors_stream; no all-gather into every rank), never a
whole-model dict; the files hold the same
tensors and the same index as the whole-dict export (write_hf_exports / save_hf_checkpoint) wrote. 2 gloo ranks in
torch.multiprocessing children (tests/helpers/dist_ranks.py)."""

from __future__ import annotations

import json
import os

import pytest
import safetensors
import safetensors.torch
import torch
from helpers.dist_ranks import config, free_port, run_ranks, step_batch, trainer_argv

SMALL_FILES = 64 * 1024  # a file size that splits the tiny model into several files (an index)


def export_worker(rank: int, world_size: int, argv: list[str], port: int, out: str) -> None:
    """A checkpoint save with the whole-model paths refused (the full state dict gather, safetensors' dict writer),
    a streamed export split into small files; then, with them allowed again, the whole-dict exports of the same
    weights at both file sizes."""
    from torch.distributed.tensor import DTensor

    import lichen.train.dist_trainer as dt
    from lichen.train import fsdp
    from lichen.train.checkpoint import write_hf_exports
    from lichen.weights import hf_io

    torch.set_num_threads(1)
    cfg, args = config(argv)
    t = dt.DistTrainer(cfg, args, rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port)
    lora = cfg.lora is not None
    if lora:  # a step, so B != 0 and the merged policy differs from the base
        t.train(0, step_batch(t.model.cfg.vocab_size, 0))
    real_full, real_save = fsdp.full_weights, safetensors.torch.save_file

    def refuse(*a, **k):
        raise AssertionError("the streamed export built a whole-model dict")

    def adapters_only(tensors, *a, **k):  # LoRA's adapter file (a few tensors) is written from a dict, as before
        if not all("lora_" in n for n in tensors):
            refuse()
        return real_save(tensors, *a, **k)

    fsdp.full_weights = refuse
    safetensors.torch.save_file = adapters_only
    real_full_tensor = DTensor.full_tensor
    if not lora:  # each tensor goes to rank 0 only (fsdp.owned_of), never an all-gather into every rank
        DTensor.full_tensor = refuse  # type: ignore[method-assign]
    t.save(os.path.join(out, "ckpt"), 0)  # hf/ at the default file size
    dt.plan_shards = lambda state: hf_io.plan_shards(state, SMALL_FILES)
    t._stream_hf(os.path.join(out, "small_stream"))
    fsdp.full_weights, safetensors.torch.save_file = real_full, real_save
    DTensor.full_tensor = real_full_tensor  # type: ignore[method-assign]
    weights = fsdp.full_weights(t.model)
    if rank == 0:
        if lora:  # the multi-rank LoRA save before streaming: the adapters and the merge from the gathered state
            from lichen.train import lora as lora_mod

            weights = lora_mod.export_rank0(
                t.actor, weights, os.path.join(out, "whole", "lora"), 0, cfg.models.hf_checkpoint
            )
        write_hf_exports(weights, os.path.join(out, "whole"), 0, cfg)
        with open(os.path.join(cfg.models.hf_checkpoint, "config.json")) as f:
            hf_config = json.load(f)
        hf_io.save_hf_checkpoint(
            weights,
            os.path.join(out, "small_whole"),
            config=hf_config,
            copy_files_from=cfg.models.hf_checkpoint,
            max_shard_bytes=SMALL_FILES,
        )
    t.close()


def _tensors(d: str) -> dict[str, dict[str, torch.Tensor]]:
    return {
        f: safetensors.torch.load_file(os.path.join(d, f)) for f in sorted(os.listdir(d)) if f.endswith(".safetensors")
    }


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["lichen", "hf", "lora"])
def test_streamed_export_equals_the_whole_dict_export(tiny_ckpt, addition_data, tmp_path, impl):
    extra = {"lichen": [], "hf": ["--model-impl", "hf"], "lora": ["--use-lora", "--lora-rank", "4", "--lr", "0.05"]}[
        impl
    ]
    argv = trainer_argv(tiny_ckpt, addition_data, str(tmp_path / "o"), *extra)
    config(argv)
    run_ranks(export_worker, 2, argv, free_port(), str(tmp_path))
    pairs = [
        (tmp_path / "ckpt" / "iter_0000000" / "hf", tmp_path / "whole" / "hf"),
        (tmp_path / "small_stream", tmp_path / "small_whole"),
    ]
    for streamed, whole in pairs:
        assert sorted(os.listdir(streamed)) == sorted(os.listdir(whole))
        a, b = _tensors(str(streamed)), _tensors(str(whole))
        assert a.keys() == b.keys() and a
        for f in a:
            assert a[f].keys() == b[f].keys(), f
            for name in a[f]:
                assert a[f][name].dtype == b[f][name].dtype and torch.equal(a[f][name], b[f][name]), (f, name)
    if impl == "lora":  # lora/: the same adapters and config as the gathered-state save wrote
        ours, theirs = tmp_path / "ckpt" / "iter_0000000" / "lora", tmp_path / "whole" / "lora"
        assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs))
        a, b = _tensors(str(ours)), _tensors(str(theirs))
        assert a.keys() == b.keys() and all(torch.equal(a[f][n], b[f][n]) for f in a for n in a[f])
        base = safetensors.torch.load_file(os.path.join(tiny_ckpt, "model.safetensors"))
        merged = _tensors(str(tmp_path / "ckpt" / "iter_0000000" / "hf"))["model.safetensors"]
        assert any(not torch.equal(merged[n], base[n]) for n in merged if n.endswith("q_proj.weight"))
    index = "model.safetensors.index.json"
    small = json.loads((tmp_path / "small_stream" / index).read_text())
    assert small == json.loads((tmp_path / "small_whole" / index).read_text())
    assert len(set(small["weight_map"].values())) > 3


def test_streamed_file_reads_back_and_refuses_a_tensor_it_did_not_announce(tmp_path):
    from lichen.weights.safetensors_stream import write_streamed

    tensors = {
        "a": torch.randn(3, 5).to(torch.bfloat16),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.randn(2, 2, 2),
    }
    rows = [(n, list(t.shape), t.dtype) for n, t in tensors.items()]
    path = str(tmp_path / "x.safetensors")
    assert write_streamed(path, rows, iter(tensors.items()), {"format": "pt"}) == sum(
        t.numel() * t.element_size() for t in tensors.values()
    )
    back = safetensors.torch.load_file(path)
    assert back.keys() == tensors.keys()
    assert all(back[n].dtype == t.dtype and torch.equal(back[n], t) for n, t in tensors.items())
    with safetensors.safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    swapped = [("b", tensors["b"]), ("a", tensors["a"]), ("c", tensors["c"])]
    with pytest.raises(ValueError, match="expected tensor 'a'"):
        write_streamed(path, rows, iter(swapped))
    with pytest.raises(ValueError, match="expected tensor 'c'"):
        write_streamed(path, rows, iter([("a", tensors["a"]), ("b", tensors["b"]), ("c", torch.zeros(2, 2))]))
