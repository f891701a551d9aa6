"""Hugging Face-style safetensors checkpoints: save (sharded, atomic) and load.

Layout written by `save_hf_checkpoint` (the one `transformers` reads):
  - everything fits in one shard: `model.safetensors`;
  - otherwise `model-00001-of-0000N.safetensors` … plus `model.safetensors.index.json`
    = {"metadata": {"total_size": <bytes of all tensors>, **metadata}, "weight_map": {name: shard file}}.
Every file's header carries `{"format": "pt"}` (transformers refuses files without it) and the caller's
`metadata`, stringified (safetensors headers hold str -> str only).

This module is a leaf of `lichen.weights`: it imports torch, safetensors and the standard library, nothing of
lichen, so engines, the trainer and `sync` can all use it.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Callable

import safetensors
import safetensors.torch
import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 1024**3  # save_hf_checkpoint's file size (a larger tensor gets a file of its own)
CONFIG_FILE = "config.json"

# Weight files of any format are never copied from `copy_files_from`: they would be stale next to the new ones.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".index.json")


def _shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _stored_nbytes(t: torch.Tensor, dtype: torch.dtype | None) -> int:
    out_dtype = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
    return t.numel() * torch.empty((), dtype=out_dtype).element_size()


def plan_shards(
    state_dict: dict[str, torch.Tensor], max_shard_bytes: int = MAX_SHARD_BYTES, dtype: torch.dtype | None = None
) -> list[list[str]]:
    """Greedy, in the state dict's order: start a new shard when the next tensor would overflow the current one.

    A tensor larger than `max_shard_bytes` gets a shard of its own (tensors are never split).
    """
    shards: list[list[str]] = [[]]
    used = 0
    for name, t in state_dict.items():
        size = _stored_nbytes(t, dtype)
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def _prepare_shard(
    state_dict: dict[str, torch.Tensor], names: list[str], dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """CPU, contiguous, cast copies of one shard's tensors; tensors that share storage are cloned apart.

    Only one shard is materialised at a time, so saving a model from GPU needs host memory for one shard.
    safetensors refuses tensors that share memory (tied embeddings, views of one buffer), hence the clones.
    """
    out: dict[str, torch.Tensor] = {}
    seen_storage: set[int] = set()
    for name in names:
        t = state_dict[name].detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        t = t.to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen_storage:  # the first holder keeps the storage; every later one gets its own copy
            t = t.clone()
        else:
            seen_storage.add(ptr)
        out[name] = t
    return out


def _header_metadata(metadata: dict | None) -> dict[str, str]:
    header = {"format": "pt"}
    for k, v in (metadata or {}).items():
        header[str(k)] = v if isinstance(v, str) else json.dumps(v)
    return header


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    # Directory fsync makes the renames durable; some filesystems refuse it, which only weakens durability.
    try:
        _fsync_file(path)
    except OSError:
        pass


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def _copy_side_files(src: str, dst: str, *, skip_config: bool) -> None:
    """Copy tokenizer, generation-config, chat-template, vocab/merges … files: every top-level regular file that
    is not weights, a weight index, or (when the caller gave a config) config.json. Hidden files are skipped."""
    if not os.path.isdir(src):
        raise FileNotFoundError(f"copy_files_from: directory {src!r} does not exist")
    for fname in sorted(os.listdir(src)):
        path = os.path.join(src, fname)
        if fname.startswith(".") or not os.path.isfile(path) or fname.endswith(_WEIGHT_SUFFIXES):
            continue
        if fname == CONFIG_FILE and skip_config:
            continue
        shutil.copy2(path, os.path.join(dst, fname))


def write_side_files(dst: str, *, config: dict | None, copy_files_from: str | None) -> None:
    """A checkpoint's files other than weights: `config` as config.json (when given) and the tokenizer, generation
    and chat-template files of `copy_files_from` (its config.json too when `config` is None)."""
    if copy_files_from is not None:
        _copy_side_files(copy_files_from, dst, skip_config=config is not None)
    if config is not None:
        _write_json(os.path.join(dst, CONFIG_FILE), config)


def save_hf_checkpoint(
    state_dict: dict[str, torch.Tensor],
    out_dir: str,
    *,
    config: dict | None = None,
    copy_files_from: str | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    dtype: torch.dtype | None = None,
    metadata: dict | None = None,
) -> None:
    """Write `state_dict` as an HF safetensors checkpoint in `out_dir`, atomically.

    - Tensors are detached, moved to CPU, made contiguous and, if `dtype` is given, floating-point ones are cast to
      it (integer and bool tensors keep their dtype). Tensors sharing storage are saved as independent copies.
    - `config` is written as config.json. With `copy_files_from`, tokenizer/generation/chat-template files are
      copied from that directory; its config.json is copied too when `config` is None.
    - Atomic: everything is written to the sibling `<out_dir>.tmp-<pid>` and fsynced; then an existing `out_dir`
      is renamed to `<out_dir>.old-<pid>`, the new one renamed into place, and the old one deleted. A failure
      while writing leaves any existing `out_dir` untouched and removes the temp directory.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    for name, t in state_dict.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict entries must be str -> torch.Tensor; got {name!r} -> {type(t).__name__}")
    write_hf_shards(
        plan_shards(state_dict, max_shard_bytes, dtype),
        lambda names: _prepare_shard(state_dict, names, dtype),
        out_dir,
        config=config,
        copy_files_from=copy_files_from,
        metadata=metadata,
    )


def write_hf_shards(
    shards: list[list[str]],
    tensors_of: Callable[[list[str]], dict[str, torch.Tensor]],
    out_dir: str,
    *,
    config: dict | None = None,
    copy_files_from: str | None = None,
    metadata: dict | None = None,
) -> None:
    """save_hf_checkpoint's layout and atomic write, one shard (a list of names) at a time: `tensors_of(names)`
    gives that shard's CPU tensors when it is written, so only one shard is ever held (the weight sync's rank 0
    streams gathered buckets through it). A multi-rank trainer's export writes the same files from every rank:
    lichen.weights.rank_hf."""
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise NotADirectoryError(f"checkpoint output {out_dir!r} exists and is not a directory")
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = f"{out_dir}.tmp-{os.getpid()}"
    if os.path.exists(tmp_dir):  # left by an earlier crash of a process with the same pid
        shutil.rmtree(tmp_dir)
    os.makedirs(tmp_dir)
    try:
        _write_checkpoint(
            shards,
            tensors_of,
            tmp_dir,
            config=config,
            copy_files_from=copy_files_from,
            metadata=metadata,
        )
        for fname in os.listdir(tmp_dir):
            _fsync_file(os.path.join(tmp_dir, fname))
        _fsync_dir(tmp_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    _swap_into_place(tmp_dir, out_dir)


def _write_checkpoint(
    shards: list[list[str]],
    tensors_of: Callable[[list[str]], dict[str, torch.Tensor]],
    dst: str,
    *,
    config: dict | None,
    copy_files_from: str | None,
    metadata: dict | None,
) -> None:
    header = _header_metadata(metadata)

    def save(names: list[str], path: str) -> int:
        tensors = tensors_of(names)
        safetensors.torch.save_file(tensors, path, metadata=header)
        return sum(t.numel() * t.element_size() for t in tensors.values())

    if len(shards) == 1:
        save(shards[0], os.path.join(dst, SINGLE_FILE))
    else:
        weight_map: dict[str, str] = {}
        total = 0
        for i, names in enumerate(shards):
            fname = _shard_name(i, len(shards))
            total += save(names, os.path.join(dst, fname))
            weight_map.update({name: fname for name in names})
        _write_json(
            os.path.join(dst, INDEX_FILE),
            {"metadata": {"total_size": total, **(metadata or {})}, "weight_map": weight_map},
        )
    write_side_files(dst, config=config, copy_files_from=copy_files_from)


def _swap_into_place(tmp_dir: str, out_dir: str) -> None:
    old_dir = f"{out_dir}.old-{os.getpid()}"
    had_old = os.path.exists(out_dir)
    if had_old:
        if os.path.exists(old_dir):
            shutil.rmtree(old_dir)
        os.rename(out_dir, old_dir)
    try:
        os.rename(tmp_dir, out_dir)
    except BaseException:
        if had_old:  # put the previous checkpoint back before reporting the failure
            os.rename(old_dir, out_dir)
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    _fsync_dir(os.path.dirname(out_dir))
    if had_old:
        shutil.rmtree(old_dir, ignore_errors=True)


def safetensors_files(model_dir: str) -> list[str]:
    """Paths of the checkpoint's weight files, in load order; [] when the directory holds no safetensors weights.

    With an index, the shards it names (sorted, each once); else `model.safetensors` if present.
    Raises FileNotFoundError when `model_dir` is not a directory or the index names a missing shard.
    """
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"checkpoint directory {model_dir!r} does not exist")
    index_path = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path}: no 'weight_map' object; the index file is damaged")
        files = [os.path.join(model_dir, fname) for fname in sorted(set(weight_map.values()))]
        missing = [p for p in files if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(
                f"{index_path} names shard(s) that do not exist: {', '.join(os.path.basename(p) for p in missing)}"
            )
        return files
    single = os.path.join(model_dir, SINGLE_FILE)
    return [single] if os.path.isfile(single) else []


def load_hf_state_dict(
    model_dir: str, *, device: str = "cpu", dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Read an HF safetensors checkpoint (single file or sharded index) into a name -> tensor dict on `device`.

    `dtype` casts floating-point tensors only. A missing directory or one without safetensors weights raises
    FileNotFoundError naming the directory.
    """
    files = safetensors_files(model_dir)
    if not files:
        present = sorted(os.listdir(model_dir))
        hint = ""
        if any(f.endswith(".bin") for f in present):
            hint = (
                " It has PyTorch .bin weights; convert them to safetensors (save_pretrained(safe_serialization=True))."
            )
        raise FileNotFoundError(
            f"no {SINGLE_FILE} or {INDEX_FILE} in checkpoint directory {model_dir!r} "
            f"(found: {', '.join(present) or 'nothing'}).{hint}"
        )
    state: dict[str, torch.Tensor] = {}
    for path in files:
        part = safetensors.torch.load_file(path, device=device)
        dup = state.keys() & part.keys()
        if dup:
            raise ValueError(f"tensor(s) {sorted(dup)[:5]} appear in more than one shard of {model_dir!r}")
        state.update(part)
    index_path = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            expected = json.load(f)["weight_map"].keys()
        missing = expected - state.keys()
        if missing:
            raise ValueError(f"{index_path} lists tensor(s) not found in its shards: {sorted(missing)[:5]}")
    if dtype is not None:
        state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    return state


def load_hf_metadata(model_dir: str) -> dict[str, str]:
    """The string metadata stored in the first weight file's header (includes "format": "pt")."""
    files = safetensors_files(model_dir)
    if not files:
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in checkpoint directory {model_dir!r}")
    with safetensors.safe_open(files[0], framework="pt") as f:
        return dict(f.metadata() or {})
