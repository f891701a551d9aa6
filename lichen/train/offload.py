"""Moving the trainer's state off the accelerator while engines generate (docs/architecture.md#offload).

Parameters and optimizer state go to pinned CPU memory and come back before training (gradients are freed after
every step). A Ray trainer rank started with torch_memory_saver's hook pauses its allocations by region tag instead
(lichen.train.memory_saver). On CPU the trainer never calls these.
"""

from __future__ import annotations

import torch


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device, pin: bool) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                moved = value.to(device, non_blocking=True)
                state[key] = moved.pin_memory() if pin else moved


def offload_to_cpu(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    # no gradients to move: lichen.train.optim.clip_and_step frees them after every step
    for p in model.parameters():
        p.data = p.data.to("cpu").pin_memory()
    _move_optimizer_state(optimizer, "cpu", pin=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def onload_to_device(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device) -> None:
    for p in model.parameters():
        p.data = p.data.to(device, non_blocking=True)
    _move_optimizer_state(optimizer, device, pin=False)
