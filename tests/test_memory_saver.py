"""torch_memory_saver by region tag in a trainer rank (lichen.train.memory_saver), checked on CPU through its
recording backend: the tag of each allocation site, and a real 1-rank DistTrainer (gloo, in a child) reading its
weights while offloaded. The order against the loop's phases, per mode, is in tests/test_offload_order.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers.dist_ranks import config, free_port, run_ranks, step_batch, trainer_argv

from lichen.train import memory_saver
from lichen.train.memory_saver import RecordingBackend, TaggedMemory

OFFLOAD = ["synchronize", "pause(default)", "pause(optimizer)", "pause(weights)"]
ONLOAD = ["resume(weights)", "resume(optimizer)", "resume(default)"]


def test_without_the_hook_every_call_is_a_no_op():
    mem = TaggedMemory()
    assert not mem.active
    with mem.region(memory_saver.WEIGHTS), mem.weights_resident():
        mem.offload()
        mem.onload()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    mem.tag_optimizer(opt)
    assert not opt._optimizer_step_pre_hooks


def test_offload_and_onload_are_idempotent():
    calls: list[str] = []
    mem = TaggedMemory(RecordingBackend(calls))
    mem.onload()  # not paused: nothing to resume
    mem.offload()
    mem.offload()
    mem.onload()
    mem.onload()
    assert calls == OFFLOAD + ONLOAD


def _rank_worker(rank: int, world_size: int, argv: list[str], port: int, out: str) -> None:
    from lichen.train.dist_trainer import DistTrainer

    calls: list[str] = []
    memory_saver.for_this_process = lambda: TaggedMemory(RecordingBackend(calls))
    cfg, args = config(argv)
    trainer = DistTrainer(cfg, args, rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port)
    seen = {"init": list(calls)}
    calls.clear()
    trainer.train(0, step_batch(trainer.model.cfg.vocab_size, 0))
    seen["train"] = list(calls)
    calls.clear()
    before = trainer.full_state_dict()
    trainer.offload()
    after = trainer.full_state_dict()  # the sync's read, after the loop's offload
    trainer.onload()
    seen["offloaded read"] = list(calls)
    seen["same weights"] = [all(torch.equal(before[k], after[k]) for k in before)]
    seen["optimizer state"] = [str(len(trainer.actor.optimizer.state))]
    trainer.close()
    torch.save(seen, out)


@pytest.mark.slow
def test_a_rank_allocates_shards_and_optimizer_state_in_their_regions(tiny_ckpt, addition_data, tmp_path):
    out = str(tmp_path / "seen.pt")
    run_ranks(
        _rank_worker,
        1,
        trainer_argv(tiny_ckpt, addition_data, str(tmp_path / "o"), "--num-threads", "1"),
        free_port(),
        out,
    )
    seen = torch.load(out, weights_only=True)
    assert seen["init"] == ["region(weights)", "end region(weights)"]  # the FSDP shards of the policy
    steps = seen["train"]
    assert steps and steps == ["region(optimizer)", "end region(optimizer)"] * (len(steps) // 2)
    read_paused = ["resume(weights)", "disable", "end disable", "synchronize", "pause(weights)"]
    assert seen["offloaded read"] == OFFLOAD + read_paused + ONLOAD
    assert seen["same weights"] == [True] and int(seen["optimizer state"][0]) > 0
