"""--optimizer-cpu-offload: FSDP2's CPUOffloadPolicy on the trainer ranks (lichen.train.fsdp.shard). On CUDA the
parameter shards, gradients and AdamW state live in host memory; a CPU trainer's already do, so the flag is off
there (fsdp.offloads_to_cpu). The policy itself runs on CPU too: here the ranks force it on (unpinned) and two
training steps of 2 gloo ranks must give the weights, losses and log-probs of the same ranks without it."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from helpers.dist_ranks import config, free_port, rank_files, rel_diff, run_ranks, step_batch, trainer_argv

from lichen.errors import ConfigError
from lichen.train import fsdp


def two_steps_worker(rank: int, world_size: int, argv: list[str], offload: bool, port: int, out: str) -> None:
    """A DistTrainer with --optimizer-cpu-offload's value `offload` and the offload decision forced to it (the CPU
    stands in for the GPU; the flag's --runtime ray rule is tested apart): the policy each FSDP unit got, two
    steps' metrics and the weights after them."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    from lichen.train.dist_trainer import DistTrainer

    torch.set_num_threads(1)
    fsdp.offloads_to_cpu = lambda requested, device: requested
    cfg, args = config(argv)
    cfg = dataclasses.replace(
        cfg, optimizer_state=dataclasses.replace(cfg.optimizer_state, optimizer_cpu_offload=offload)
    )
    t = DistTrainer(cfg, args, rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port)
    policies = {
        type(m._get_fsdp_state()._fsdp_param_group.offload_policy) is CPUOffloadPolicy
        for m in t.model.modules()
        if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group is not None
    }
    metrics = [t.train(step, step_batch(t.model.cfg.vocab_size, step)) for step in range(2)]
    weights = t.full_state_dict()
    torch.save({"policies": policies, "metrics": metrics, "weights": weights}, os.path.join(out, f"rank{rank}.pt"))
    t.close()


def _run(tmp_path, argv: list[str], offload: bool) -> list[dict]:
    out = tmp_path / f"offload{offload}"
    out.mkdir()
    run_ranks(two_steps_worker, 2, argv, offload, free_port(), str(out))
    return rank_files(out, 2)


@pytest.mark.slow
def test_offloaded_ranks_train_exactly_as_the_resident_ones(tiny_ckpt, addition_data, tmp_path):
    argv = trainer_argv(tiny_ckpt, addition_data, str(tmp_path / "o"), "--use-kl-loss", "--kl-loss-coef", "0.1")
    resident = _run(tmp_path, argv, False)
    offloaded = _run(tmp_path, argv, True)
    assert offloaded[0]["policies"] == {True} and resident[0]["policies"] == {False}
    for a, b in zip(offloaded[0]["metrics"], resident[0]["metrics"]):
        assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-6)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-6)
    worst = max(rel_diff(offloaded[0]["weights"][n], w) for n, w in resident[0]["weights"].items())
    assert worst <= 1e-6, worst
    changed = max((offloaded[0]["weights"][n] - w).abs().max().item() for n, w in _initial(tiny_ckpt).items())
    assert changed > 0  # two optimizer steps moved the weights


def _initial(ckpt: str) -> dict[str, torch.Tensor]:
    import safetensors.torch

    return safetensors.torch.load_file(os.path.join(ckpt, "model.safetensors"))


def test_the_flag_takes_effect_on_cuda_only():
    assert fsdp.offloads_to_cpu(True, torch.device("cuda"))
    assert not fsdp.offloads_to_cpu(True, torch.device("cpu"))
    assert not fsdp.offloads_to_cpu(False, torch.device("cuda"))
    # host and device collectives both: gradient clipping reduces the norm of CPU-resident DTensors
    assert fsdp.default_backend(torch.device("cuda"), cpu_offload=True) == "cpu:gloo,cuda:nccl"
    assert fsdp.default_backend(torch.device("cuda")) == "nccl"
    assert fsdp.default_backend(torch.device("cpu"), cpu_offload=True) == "gloo"


def test_the_local_runtime_refuses_it(tiny_ckpt, addition_data, tmp_path):
    with pytest.raises(ConfigError, match="--optimizer-cpu-offload needs --runtime ray"):
        config(trainer_argv(tiny_ckpt, addition_data, str(tmp_path / "o"), "--optimizer-cpu-offload"))
