"""Training checkpoints: `--save DIR` writes `DIR/iter_{rollout_id:07d}/`, `--load DIR` resumes from the newest
intact one.

Layout of one checkpoint:
  hf/                 the policy as a Hugging Face checkpoint (safetensors + config + tokenizer): loadable by
                      `from_pretrained`, and what a resume loads the weights from
  trainer_state.pt    optimizer state (left out with --no-save-optim), optimizer step count, RNG states (tensors
                      and plain data only)
  critic.pt           --advantage-estimator ppo: the critic's weights and optimizer state
  lora/               --use-lora: the adapters as peft's adapter directory (docs/lora.md); hf/ is then the merged
                      policy, and a resume restores the adapters onto --hf-checkpoint's base weights
  dist/               --runtime ray: the ranks' sharded state (torch.distributed.checkpoint) instead of
                      trainer_state.pt; hf/ is then rank 0's export
  rollout_state.json  the data source position (and anything else the rollout side needs to resume)
  meta.json           rollout_id, weight_version, world_size (the trainer ranks that saved it; 1 locally)
  checksums.json      size and xxh3-128 digest of every file above (lichen.train.ckpt_integrity); written last
`DIR/latest_checkpointed_iteration.txt` names the newest complete checkpoint; it is written after checksums.json,
so a crash during a save leaves the previous checkpoint as the one that resumes.

One writer (`save_checkpoint`): the trainer (lichen.train.trainer_protocol.Trainer.save) writes its own files and
returns their manifest entries, hashed by the process that wrote them (each rank its share); this module then
writes rollout_state.json, meta.json, checksums.json and, last, `latest`. No other code writes those four.

--async-save (the default): the trainer copies what it saves into CPU buffers (`save_async`) and the same writes,
in the same order, run in a background thread (lichen.train.ckpt_async); the next save, the end of the run and
`find_latest` wait for it. The manifest and `latest` still come after every file, so a crash during the write
leaves the previous checkpoint as the one that resumes.

Resuming verifies every file against checksums.json before anything is loaded. A damaged checkpoint (a file
missing, truncated or changed, a rollout_state.json or meta.json that does not parse, or a bad `latest` file) is
named in a warning and the newest older intact one is loaded instead; when none is intact the run stops with exit code 2. A checkpoint without checksums.json (an
unfinished save, or written by a lichen before checksums, whose trainer_state.pt cannot be read safely) is never
loaded: resume it with the lichen that wrote it, or start from its weights with `--hf-checkpoint iter_N/hf`.

--save-hf PATH writes the same HF export again to PATH.format(rollout_id=N), outside the checkpoint (no manifest
entry: it is the user's copy, not what a resume reads). A checkpoint without optimizer state (--no-save-optim)
resumes with a fresh optimizer and one warning; the learning-rate schedule's position and the RNG states resume.

The .pt files are read with `torch.load(weights_only=True)` (lichen.torch_files): they hold tensors and plain
Python values only (the numpy RNG state is stored as a tensor and plain fields), so loading one never runs code.
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from lichen.config.train_config import TrainerConfig
from lichen.errors import ConfigError
from lichen.observe.metrics import get_logger
from lichen.torch_files import load_plain, save_plain
from lichen.train import ckpt_async
from lichen.train.ckpt_async import Snapshot, wait_for_saves
from lichen.train.ckpt_integrity import (
    MANIFEST,
    NO_MANIFEST,
    CheckpointDamaged,
    atomic_write_text,
    checkpoint_files,
    file_entries,
    open_inside,
    read_inside,
    remove_manifest,
    remove_stale_temps,
    verify,
    write_manifest,
)
from lichen.weights.hf_io import save_hf_checkpoint

log = get_logger(__name__)

LATEST = "latest_checkpointed_iteration.txt"
META = "meta.json"
DIST_DIR = "dist"  # the sharded (torch.distributed.checkpoint) state of a multi-rank trainer
TRAINER_STATE = "trainer_state.pt"
CRITIC_FILE = "critic.pt"
LORA_DIR = "lora"
ROLLOUT_STATE = "rollout_state.json"
STATE_FORMAT = 2  # 2: plain data only (weights_only=True); 1 (no "format" key) pickled numpy's RNG state
_ITER = re.compile(r"^iter_(\d{7,})$")
_MAX_LATEST_BYTES = 64  # a rollout id and a newline


def iter_dir(save_dir: str, rollout_id: int) -> str:
    return os.path.join(save_dir, f"iter_{rollout_id:07d}")


def rng_state() -> dict:
    """The RNG states as tensors and plain values (numpy's key array becomes an int64 tensor)."""
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "bit_generator": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"].cpu())
    n = state["numpy"]
    np.random.set_state(
        (n["bit_generator"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


@dataclass
class SavedTrainer:
    """What a trainer's `save` wrote into a checkpoint: each file's manifest entry (ckpt_integrity.file_entries),
    hashed by the process that wrote it, and what meta.json records about the trainer."""

    files: dict[str, dict] = field(default_factory=dict)  # path relative to iter_N/ -> {"size", "xxh3_128"}
    world_size: int = 0  # trainer ranks that saved it (0: no trainer state, --debug-rollout-only)


def begin_save(save_dir: str, rollout_id: int) -> str:
    """Create (or reopen) the checkpoint directory as unfinished, after removing crashed saves' temp entries."""
    for path in remove_stale_temps(save_dir):
        log.info("removed %s, left by a save that did not finish", path)
    d = iter_dir(save_dir, rollout_id)
    os.makedirs(d, exist_ok=True)
    remove_manifest(d)
    return d


def write_hf_exports(weights: dict[str, torch.Tensor], d: str, rollout_id: int, cfg: TrainerConfig) -> None:
    """The policy `weights` as checkpoint `d`'s hf/ and, with --save-hf (`cfg.checkpoint.save_hf`), as the same
    export at save_hf.format(rollout_id=...); config.json and the tokenizer files come from
    cfg.models.hf_checkpoint. (The local trainer's save and rank 0 of the multi-rank trainer both write through
    here.)"""
    hf_checkpoint, save_hf = cfg.models.hf_checkpoint, cfg.checkpoint.save_hf
    with open(os.path.join(hf_checkpoint, "config.json")) as f:
        config = json.load(f)
    save_hf_checkpoint(weights, os.path.join(d, "hf"), config=config, copy_files_from=hf_checkpoint)
    if save_hf:
        from lichen.config.train_config import save_hf_dir

        out = save_hf_dir(save_hf, rollout_id)
        save_hf_checkpoint(weights, out, config=config, copy_files_from=hf_checkpoint)
        log.info("--save-hf: wrote the policy of checkpoint %d as an HF checkpoint to %s", rollout_id, out)


def save_trainer(save_dir: str, rollout_id: int, trainer) -> SavedTrainer:
    """Write `trainer.state_dict()` (lichen.train.actor.TrainActor) as hf/, trainer_state.pt and critic.pt (and
    lora/), the optimizer states left out with --no-save-optim; returns their manifest entries."""
    d = iter_dir(save_dir, rollout_id)
    os.makedirs(d, exist_ok=True)
    files = _trainer_files(trainer)
    written = _write_trainer_files(d, rollout_id, trainer.cfg, files)
    if trainer.cfg.lora is not None:  # --use-lora: hf/ is the merged policy; the adapters are what a resume restores
        from lichen.train import lora

        hf_checkpoint = trainer.cfg.models.hf_checkpoint
        lora.save_adapter(trainer.model, trainer.cfg.lora, os.path.join(d, LORA_DIR), hf_checkpoint)
        lora.save_exports(trainer, files["weights"], rollout_id, hf_checkpoint)
        written.append(LORA_DIR)
    return SavedTrainer(written_entries(d, written), world_size=1)


def snapshot_trainer(save_dir: str, rollout_id: int, trainer, snapshot: Snapshot) -> Callable[[], SavedTrainer] | None:
    """--async-save of the local trainer: copy what save_trainer writes into `snapshot`'s CPU buffers now, and
    return the function that writes those copies as the same files (byte for byte) and returns their manifest
    entries, from any thread. None with --use-lora (the adapter files are written from the live model: that save
    stays synchronous)."""
    if trainer.cfg.lora is not None:
        return None
    d = iter_dir(save_dir, rollout_id)
    os.makedirs(d, exist_ok=True)
    files = snapshot.take(_trainer_files(trainer))
    cfg = trainer.cfg

    def write() -> SavedTrainer:
        return SavedTrainer(written_entries(d, _write_trainer_files(d, rollout_id, cfg, files)), world_size=1)

    return write


def _trainer_files(trainer) -> dict:
    """What the local trainer's files hold, as references to its live state: "weights" (hf/), "trainer_state"
    (trainer_state.pt: the optimizer unless --no-save-optim, step count, RNG states) and "critic" (critic.pt)."""
    state = trainer.state_dict()
    files = {
        "weights": {k: v.detach() for k, v in state["model"].items()},
        "trainer_state": {"format": STATE_FORMAT, "opt_step": state["opt_step"], "rng": rng_state()},
    }
    if not trainer.cfg.checkpoint.no_save_optim:
        files["trainer_state"]["optimizer"] = state["optimizer"]
    elif "critic" in state:  # slime's critic saves under the same flag
        state["critic"] = {k: v for k, v in state["critic"].items() if k != "optimizer"}
    if "critic" in state:
        files["critic"] = state["critic"]
    return files


def _write_trainer_files(d: str, rollout_id: int, cfg: TrainerConfig, files: dict) -> list[str]:
    """Write `files` (_trainer_files) into checkpoint `d` (and --save-hf's export); the top-level entries written."""
    write_hf_exports(files["weights"], d, rollout_id, cfg)
    save_plain(files["trainer_state"], os.path.join(d, TRAINER_STATE))
    written = ["hf", TRAINER_STATE]
    if "critic" in files:
        save_plain(files["critic"], os.path.join(d, CRITIC_FILE))
        written.append(CRITIC_FILE)
    return written


def written_entries(d: str, tops: list[str]) -> dict[str, dict]:
    """Manifest entries of the files of checkpoint `d` under the top-level entries `tops` (files or folders)."""
    rels = [rel for rel in checkpoint_files(d) if rel.split("/", 1)[0] in tops]
    return file_entries(d, rels)


def save_checkpoint(save_dir: str, rollout_id: int, trainer, rollout_state: dict, *, asynchronous: bool = False) -> str:
    """Write checkpoint `rollout_id` under `save_dir`, the only writer of its meta.json, checksums.json and of
    `latest`: the trainer's files (`trainer.save`, hashed where they were written), then rollout_state.json, then
    meta.json, then checksums.json, then `latest`. A crash between any two writes leaves either the previous
    checkpoint or this one as the one a resume loads (docs/checkpoints.md#one-writer).

    `asynchronous` (--async-save), for a trainer with `save_async`: the trainer copies its state now and the
    same writes, in the same order, run in a background thread (lichen.train.ckpt_async); this returns once the
    copy is taken. Every save first waits for the write in flight."""
    ckpt_async.wait_for_saves()  # one write at a time (and begin_save's temp cleanup never meets our own writer)
    d = begin_save(save_dir, rollout_id)
    start = getattr(trainer, "save_async", None) if asynchronous else None
    write = start(save_dir, rollout_id) if start is not None else None
    if write is None:
        ckpt_async.hook("start", rollout_id)
        saved = trainer.save(save_dir, rollout_id)
        ckpt_async.hook("files", rollout_id)  # the files are written, nothing says so yet (the chaos run kills here)
        commit(save_dir, rollout_id, saved, rollout_state)
        return d
    state = copy.deepcopy(rollout_state)  # as it is now: the rollout side moves on while the files are written

    def write_and_commit() -> None:
        ckpt_async.hook("start", rollout_id)
        saved = write()
        ckpt_async.hook("files", rollout_id)
        commit(save_dir, rollout_id, saved, state)

    ckpt_async.start(rollout_id, write_and_commit)
    return d


def commit(save_dir: str, rollout_id: int, saved: SavedTrainer, rollout_state: dict) -> None:
    """The end of a save, after the trainer wrote `saved`: rollout_state.json, meta.json, checksums.json (the
    trainer's entries as given, never re-hashed, plus these two), and last `latest`."""
    d = iter_dir(save_dir, rollout_id)
    atomic_write_text(os.path.join(d, ROLLOUT_STATE), json.dumps(rollout_state, sort_keys=True))
    meta = {"rollout_id": rollout_id, "weight_version": str(rollout_id + 1), "world_size": saved.world_size}
    atomic_write_text(os.path.join(d, META), json.dumps(meta))
    files = {**saved.files, **file_entries(d, [ROLLOUT_STATE, META])}
    write_manifest(d, files)
    atomic_write_text(os.path.join(save_dir, LATEST), f"{rollout_id}\n")


def _resume_problem(d: str) -> str | None:
    """Why a checkpoint that verified still cannot resume (its rollout_state.json or meta.json absent from its
    manifest, or not a JSON object; a multi-rank trainer's dist/ without the .metadata file torch.distributed.
    checkpoint loads first), else None."""
    dist_dir = os.path.join(d, DIST_DIR)
    if os.path.isdir(dist_dir) and not os.path.isfile(os.path.join(dist_dir, ".metadata")):
        return f"{DIST_DIR}/.metadata: missing (the sharded state cannot be loaded)"
    for name in (ROLLOUT_STATE, META):
        try:
            with open_inside(d, name) as f:
                value = json.load(f)
        except CheckpointDamaged as e:
            return str(e)
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
            return f"{name}: unreadable ({str(e)[:200]})"
        if not isinstance(value, dict):
            return f"{name}: not a JSON object"
    return None


def _checkpoint_ids(load_dir: str) -> list[int]:
    if not os.path.isdir(load_dir):  # --load naming the --save directory of a run that has not saved yet
        return []
    ids = [int(m.group(1)) for m in map(_ITER.match, os.listdir(load_dir)) if m]
    return sorted(i for i in ids if os.path.isdir(iter_dir(load_dir, i)))


def _symlinked(load_dir: str, rollout_id: int) -> str | None:
    """What is wrong with checkpoint `rollout_id` if its directory is a symlink (lichen never saves one: a link would
    let a planted directory elsewhere, /proc/self for one, pass as a checkpoint of `load_dir`), else None."""
    if os.path.islink(iter_dir(load_dir, rollout_id)):
        return "a symlink, not a directory a save wrote; refused"
    return None


def _read_latest(load_dir: str) -> tuple[int | None, str | None]:
    """(the rollout id the `latest` file names, None) or (None, what is wrong with it); (None, None) if absent."""
    if not os.path.lexists(os.path.join(load_dir, LATEST)):
        return None, None
    try:
        # a regular file inside load_dir, at most a few digits: never a FIFO, /dev/zero or /proc file (ckpt_integrity)
        text = read_inside(load_dir, LATEST, _MAX_LATEST_BYTES).decode("utf-8").strip()
        if not text.isdigit():
            raise ValueError(f"holds {text[:40]!r}, not a rollout id")
        return int(text), None
    except CheckpointDamaged as e:
        return None, str(e)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return None, f"{LATEST}: {e}"


def find_latest(load_dir: str) -> int | None:
    """The rollout id of the newest intact checkpoint in `load_dir`, verified against its checksums.

    None when `load_dir` holds no checkpoint at all (start fresh). A damaged newest checkpoint, or a bad `latest`
    file, is named in a warning and the newest older intact checkpoint is returned; when checkpoints exist and
    none is intact, raises ConfigError (exit code 2) naming what is wrong with each.
    """
    wait_for_saves(raise_errors=False)  # this process' write in flight (--async-save) is committed, or failed
    latest, latest_problem = _read_latest(load_dir)
    ids = _checkpoint_ids(load_dir)
    problems = [latest_problem] if latest_problem else []
    if latest is not None:
        if latest not in ids:
            problems.append(f"{os.path.basename(iter_dir(load_dir, latest))}: missing (named by {LATEST})")
        ids = [i for i in ids if i <= latest]  # newer ones are saves that did not finish
    elif latest_problem is None and not ids:
        return None
    for rollout_id in reversed(ids):
        name = os.path.basename(iter_dir(load_dir, rollout_id))
        link = _symlinked(load_dir, rollout_id)
        if link:
            problems.append(f"{name}: {link}")
            continue
        try:
            verify(iter_dir(load_dir, rollout_id))
        except CheckpointDamaged as e:
            problems.append(f"{name}/{e}")
            continue
        unresumable = _resume_problem(iter_dir(load_dir, rollout_id))
        if unresumable:
            problems.append(f"{name}/{unresumable}")
            continue
        if latest is not None and rollout_id < latest:
            log.warning(
                "!!! --load %s: %s. Resuming from the newest intact checkpoint, %s, instead: rollout ids "
                "%d..%d run again.",
                load_dir,
                _summary(problems),
                name,
                rollout_id + 1,
                latest,
            )
        elif problems or latest is None:
            log.warning(
                "!!! --load %s: %s. Resuming from the newest intact checkpoint, %s.",
                load_dir,
                _summary(problems or [f"no {LATEST}"]),
                name,
            )
        return rollout_id
    if latest is None and latest_problem is None:
        log.warning(
            "--load %s: no %s and no finished checkpoint (%s): starting from --hf-checkpoint",
            load_dir,
            LATEST,
            _summary(problems),
        )
        return None
    raise _no_intact_checkpoint(load_dir, ids, problems)


def _no_intact_checkpoint(load_dir: str, ids: list[int], problems: list[str]) -> ConfigError:
    newest = os.path.join(load_dir, os.path.basename(iter_dir(load_dir, ids[-1])) if ids else "iter_N", "hf")
    if ids and len(problems) == len(ids) and all(p.endswith(NO_MANIFEST) for p in problems):
        return ConfigError(
            f"--load {load_dir}: its checkpoints have no {MANIFEST}: they were written by a lichen from before "
            "checkpoint checksums (their trainer_state.pt cannot be loaded safely), or their saves did not finish. "
            f"Resume them with the lichen version that wrote them, or start from the weights with --hf-checkpoint "
            f"{newest} (a fresh optimizer) and without --load"
        )
    return ConfigError(
        f"--load {load_dir}: no intact checkpoint to resume from: {_summary(problems)}. Restore the damaged files, "
        f"start from a checkpoint's weights with --hf-checkpoint {newest} and without --load, or drop --load to "
        "start from the --hf-checkpoint you gave"
    )


def _summary(problems: list[str], most: int = 3) -> str:
    more = f"; and {len(problems) - most} more" if len(problems) > most else ""
    return "; ".join(problems[:most]) + more


def load_trainer(load_dir: str, rollout_id: int, trainer) -> None:
    """Restore `trainer` (its load_state_dict) and the RNG states from checkpoint `rollout_id` in `load_dir`."""
    from lichen.weights.hf_io import load_hf_state_dict

    d = iter_dir(load_dir, rollout_id)
    if os.path.isdir(os.path.join(d, DIST_DIR)) and not os.path.isfile(os.path.join(d, TRAINER_STATE)):
        raise ConfigError(
            f"checkpoint {d} was saved by --runtime ray's {_saved_ranks(d)}: its optimizer state is sharded "
            f"({DIST_DIR}/), which the local trainer does not read. Resume it with --runtime ray (any number of "
            f"ranks), or start from its weights with --hf-checkpoint {d}/hf and without --load"
        )
    if not os.path.isdir(os.path.join(d, "hf")) or not os.path.isfile(os.path.join(d, TRAINER_STATE)):
        raise ConfigError(
            f"checkpoint {d} has no trainer state (hf/, {TRAINER_STATE}): it was saved with "
            "--debug-rollout-only; resume it with --debug-rollout-only, or start without --load"
        )
    state = load_plain(os.path.join(d, TRAINER_STATE), "checkpoint file")
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise ConfigError(
            f"checkpoint {d}/{TRAINER_STATE}: not format {STATE_FORMAT} (written by another version "
            f"of lichen?); start from its weights with --hf-checkpoint {d}/hf"
        )
    restored = {"opt_step": state["opt_step"]}
    if "optimizer" in state:
        restored["optimizer"] = state["optimizer"]
    else:
        warn_fresh_optimizer(d)
    if _lora_of(trainer) is not None:
        from lichen.train.lora import read_adapter

        if not os.path.isdir(os.path.join(d, LORA_DIR)):
            raise ConfigError(
                f"checkpoint {d} has no {LORA_DIR}/: it was saved without --use-lora; resume it "
                f"without --use-lora, or start adapters on its weights with --hf-checkpoint {d}/hf"
            )
        restored["lora"] = read_adapter(os.path.join(d, LORA_DIR))
    elif os.path.isdir(os.path.join(d, LORA_DIR)):
        raise ConfigError(
            f"checkpoint {d} was saved with --use-lora: resume it with --use-lora and the same "
            f"targets and rank, or start from its merged weights with --hf-checkpoint {d}/hf"
        )
    else:
        restored["model"] = load_hf_state_dict(os.path.join(d, "hf"), device=str(trainer.device))
    if "critic" in trainer.state_dict():
        restored["critic"] = read_critic_state(d)
    trainer.load_state_dict(restored)
    set_rng_state(state["rng"])


def warn_fresh_optimizer(d: str) -> None:
    """The one warning of a resume from a checkpoint saved without optimizer state (--no-save-optim)."""
    log.warning(
        "!!! checkpoint %s has no optimizer state (saved with --no-save-optim): the optimizer starts fresh (Adam "
        "moments and step counts from zero); the weights, the learning-rate schedule's position and the RNG "
        "states resume",
        d,
    )


def _saved_ranks(d: str) -> str:
    """'N trainer ranks' as meta.json records them (verified before this is read), else 'trainer ranks'."""
    try:
        with open_inside(d, META) as f:
            n = json.load(f).get("world_size")
    except (OSError, ValueError, AttributeError, CheckpointDamaged):
        n = None
    return f"{n} trainer rank{'s' if n != 1 else ''}" if isinstance(n, int) and n > 0 else "trainer ranks"


def _lora_of(trainer):
    cfg = getattr(trainer, "cfg", None)
    return getattr(cfg, "lora", None)


def read_critic_state(directory: str) -> dict:
    """The critic's state from `directory`/critic.pt, read with weights_only=True (tensors land on the CPU; the
    critic's load_state_dict copies them onto its device)."""
    path = os.path.join(directory, CRITIC_FILE)
    if not os.path.isfile(path):
        raise ConfigError(
            f"checkpoint {directory} has no {CRITIC_FILE}: it was saved without "
            "--advantage-estimator ppo; resume it with the estimator it was saved with"
        )
    return load_plain(path, "checkpoint file")


def load_rollout_state(load_dir: str, rollout_id: int) -> dict:
    d = iter_dir(load_dir, rollout_id)
    path = os.path.join(d, ROLLOUT_STATE)
    try:
        with open_inside(d, ROLLOUT_STATE) as f:  # regular, inside the checkpoint: its size bounds the read
            return json.load(f)
    except CheckpointDamaged as e:
        raise ConfigError(f"checkpoint {d}/{e}") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ConfigError(f"checkpoint {path}: unreadable ({str(e)[:200]})") from None
