"""Training checkpoints: `--save DIR` writes `DIR/iter_{rollout_id:07d}/`, `--load DIR` resumes from the latest.

Layout of one checkpoint:
  hf/                 the policy as a Hugging Face checkpoint (safetensors + config + tokenizer): loadable by
                      `from_pretrained`, and what a resume loads the weights from
  trainer_state.pt    optimizer state, optimizer step count, RNG states
  rollout_state.json  the data source position (and anything else the rollout side needs to resume)
  meta.json           rollout_id, weight_version
`DIR/latest_checkpointed_iteration.txt` names the newest complete checkpoint; it is written last, so a crash
during a save leaves the previous checkpoint as the one that resumes.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import torch

from lichen.weights.hf_io import save_hf_checkpoint

LATEST = "latest_checkpointed_iteration.txt"


def iter_dir(save_dir: str, rollout_id: int) -> str:
    return os.path.join(save_dir, f"iter_{rollout_id:07d}")


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_trainer(save_dir: str, rollout_id: int, actor, hf_checkpoint: str) -> str:
    d = iter_dir(save_dir, rollout_id)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(hf_checkpoint, "config.json")) as f:
        config = json.load(f)
    state = {k: v.detach() for k, v in actor.model.state_dict().items()}
    save_hf_checkpoint(state, os.path.join(d, "hf"), config=config, copy_files_from=hf_checkpoint)
    torch.save(
        {"optimizer": actor.optimizer.state_dict(), "opt_step": actor.opt_step, "rng": rng_state()},
        os.path.join(d, "trainer_state.pt"),
    )
    if getattr(actor, "critic", None) is not None:
        actor.critic.save(d)
    return d


def save_rollout_state(save_dir: str, rollout_id: int, state: dict) -> None:
    d = iter_dir(save_dir, rollout_id)
    os.makedirs(d, exist_ok=True)
    _atomic_write_text(os.path.join(d, "rollout_state.json"), json.dumps(state, sort_keys=True))


def mark_complete(save_dir: str, rollout_id: int) -> None:
    """Record `rollout_id` as the newest complete checkpoint (weights trained for rollout_id + 1 steps)."""
    meta = {"rollout_id": rollout_id, "weight_version": str(rollout_id + 1)}
    _atomic_write_text(os.path.join(iter_dir(save_dir, rollout_id), "meta.json"), json.dumps(meta))
    _atomic_write_text(os.path.join(save_dir, LATEST), str(rollout_id))


def find_latest(load_dir: str) -> int | None:
    path = os.path.join(load_dir, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return int(f.read().strip())


def load_trainer(load_dir: str, rollout_id: int, actor) -> None:
    from lichen.weights.hf_io import load_hf_state_dict

    d = iter_dir(load_dir, rollout_id)
    weights = load_hf_state_dict(os.path.join(d, "hf"), device=str(actor.device))
    actor.model.load_state_dict(weights, strict=True)
    state = torch.load(os.path.join(d, "trainer_state.pt"), map_location=actor.device, weights_only=False)
    actor.optimizer.load_state_dict(state["optimizer"])
    actor.opt_step = state["opt_step"]
    if getattr(actor, "critic", None) is not None:
        actor.critic.load(d)
    set_rng_state(state["rng"])


def load_rollout_state(load_dir: str, rollout_id: int) -> dict:
    with open(os.path.join(iter_dir(load_dir, rollout_id), "rollout_state.json")) as f:
        return json.load(f)
