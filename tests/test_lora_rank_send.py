"""LoRA's merged weights sent by the trainer ranks (issue 27): each rank's sender serves the merged policy (W +
alpha/r B A under the names without adapters), built as each adapted weight is gathered, so the engines get it
bucket by bucket like the full weights and the driver receives no tensor. 2 ranks in torch.multiprocessing
children against the gathered-state merge (DistTrainer.full_state_dict), and a --runtime ray run with the
driver-side guard."""

from __future__ import annotations

import os

import pytest
import safetensors.torch
import torch
from helpers.dist_ranks import config, free_port, rank_files, run_ranks, step_batch, trainer_argv
from helpers.trainer import recorded_grads

LORA = ["--use-lora", "--lora-rank", "4", "--lora-alpha", "8", "--lr", "0.05"]


def merged_worker(rank: int, world_size: int, argv: list[str], port: int, out: str) -> None:
    """After a step (so B != 0): the sender's metadata and every tensor it gathers in small buckets (the `rows`
    op, whole rows), and the merge of the whole gathered state; which parameters had a gradient in the step and which
    still hold one once the sync began."""
    from lichen.train.dist_trainer import DistTrainer

    torch.set_num_threads(1)
    cfg, args = config(argv)
    t = DistTrainer(cfg, args, rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port)
    with recorded_grads(t.model, t.actor.optimizer) as seen:
        t.train(0, step_batch(t.model.cfg.vocab_size, 0))
    grads = list(seen[0])  # the adapters' (LoRA trains those)
    meta = t.sync_weights("meta")
    grads_in_sync = [n for n, p in t.model.named_parameters() if p.grad is not None]
    sent: dict = {}
    names = [row[0] for row in meta]
    for i in range(0, len(names), 3):  # buckets of 3 tensors, every rank in the same order
        got = t.sync_weights("rows", names[i : i + 3], "float32", None)
        if got is not None:
            sent.update(got)
    whole = t.full_state_dict()
    torch.save(
        {"meta": meta, "sent": sent, "whole": whole, "grads": grads, "grads_in_sync": grads_in_sync},
        os.path.join(out, f"rank{rank}.pt"),
    )
    t.close()


@pytest.mark.slow
def test_ranks_send_the_merged_policy_bucket_by_bucket(tiny_ckpt, addition_data, tmp_path):
    argv = trainer_argv(tiny_ckpt, addition_data, str(tmp_path / "o"), *LORA)
    config(argv)
    run_ranks(merged_worker, 2, argv, free_port(), str(tmp_path))
    ranks = rank_files(tmp_path, 2)
    r0 = ranks[0]
    # only the adapters had gradients, freed after the step: a rank's sync memory holds no gradient shard
    assert all(r["grads"] and all(".lora_" in n for n in r["grads"]) and r["grads_in_sync"] == [] for r in ranks)
    whole = r0["whole"]
    assert [row[0] for row in r0["meta"]] == list(whole)  # the engines' names, in the merged order
    assert all(".lora_" not in n and ".base_layer" not in n for n in whole)
    assert all(row[1] == list(whole[row[0]].shape) for row in r0["meta"])
    assert r0["sent"].keys() == whole.keys()
    for n, w in whole.items():
        assert torch.equal(r0["sent"][n], w), n
    adapted = [n for n in whole if n.endswith("q_proj.weight")]
    base = safetensors.torch.load_file(os.path.join(tiny_ckpt, "model.safetensors"))
    assert adapted and any(not torch.equal(whole[n], base[n]) for n in adapted)  # B A is in it


BUCKET = 16 * 1024


@pytest.mark.slow
@pytest.mark.e2e
def test_lora_ray_run_driver_receives_no_tensor(tiny_ckpt, addition_data, tmp_path, monkeypatch):
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'lichen[ray]')")
    from helpers.ray_local import shared_ray
    from helpers.runs import base_args, run
    from helpers.sync_guard import assert_served_what_was_sent, record_checksums, record_ray_gets

    shared_ray()
    served = record_checksums(monkeypatch)
    received = record_ray_gets(monkeypatch, ray)
    metrics = run(
        base_args(
            tiny_ckpt,
            addition_data,
            tmp_path / "out",
            *LORA,
            "--device",
            "cpu",
            "--num-threads",
            "1",
            "--num-rollout",
            "2",
            "--runtime",
            "ray",
            "--actor-num-gpus-per-node",
            "2",
            "--rollout-num-gpus",
            "1",
            "--update-weight-buffer-size",
            str(BUCKET),
        )
    )
    monkeypatch.undo()
    assert received and not any(received), f"the driver received {max(received)} bytes of tensors"
    assert_served_what_was_sent(served, 3)  # versions 0-2: the merged checksums the ranks sent
    steps = [m for m in metrics if "train/loss" in m]
    assert [m["sync/weight_version"] for m in steps] == [1, 2]
    assert all(m["train/train_rollout_logprob_abs_diff"] <= 1e-5 for m in steps)
