"""One checkpoint writer (issue 27 item 4): lichen.train.checkpoint writes rollout_state.json, meta.json, the manifest
and, last, `latest`; the trainer's files come with their hashes, which the writer reuses. A crash between any two
writes of a save leaves the previous or the new checkpoint as the one a resume loads, never one that verifies but
cannot resume; a checkpoint that verifies but cannot resume (no rollout_state.json) is passed over with a warning."""

from __future__ import annotations

import json
import os

import pytest
import xxhash
from helpers.dist_ranks import step_batch
from helpers.trainer import make_actor

from lichen.errors import ConfigError
from lichen.loop import NullTrainer
from lichen.train import checkpoint as ckpt
from lichen.train import ckpt_integrity
from lichen.train.ckpt_integrity import MANIFEST, CheckpointDamaged, verify, write_manifest


class Crash(Exception):
    """The injected crash."""


def _resumable(save: str, rollout_id: int, trainer) -> dict:
    """Load checkpoint `rollout_id` as `--load` does (the trainer, then the rollout state); its rollout state."""
    trainer.load(save, rollout_id)
    return ckpt.load_rollout_state(save, rollout_id)


def test_a_crash_between_any_two_writes_leaves_the_previous_or_the_new_checkpoint(
    tiny_ckpt, addition_data, tmp_path, monkeypatch
):
    trainer = make_actor(tiny_ckpt, addition_data, tmp_path / "o")
    vocab = trainer.model.cfg.vocab_size
    save = str(tmp_path / "ckpt")
    trainer.train(0, step_batch(vocab, 0))
    ckpt.save_checkpoint(save, 0, trainer, {"sample_offset": 0})
    trainer.train(1, step_batch(vocab, 1))

    real_replace, real_rename = os.replace, os.rename
    renamed: list[str] = []
    resumed_from: list[int] = []
    k = 0
    while True:  # crash at the k-th rename (every atomic write ends in one), for every k of a save
        count = [0]

        def counted(real):
            def write(src, dst, *a, **kw):
                if count[0] == k:
                    raise Crash(f"write {k}")
                count[0] += 1
                renamed.append(os.path.relpath(str(dst), save))
                return real(src, dst, *a, **kw)

            return write

        renamed.clear()
        monkeypatch.setattr(os, "replace", counted(real_replace))
        monkeypatch.setattr(os, "rename", counted(real_rename))
        try:
            ckpt.save_checkpoint(save, 1, trainer, {"sample_offset": 1})
            finished = True
        except Crash:
            finished = False
        monkeypatch.setattr(os, "replace", real_replace)
        monkeypatch.setattr(os, "rename", real_rename)
        last = ckpt.find_latest(save)
        assert last == (1 if finished else last) and last in (0, 1), (k, last)
        assert _resumable(save, last, trainer) == {"sample_offset": last}
        for rollout_id in (0, 1):  # no checkpoint verifies that cannot resume
            try:
                verify(ckpt.iter_dir(save, rollout_id))
            except CheckpointDamaged:
                continue
            assert _resumable(save, rollout_id, trainer) == {"sample_offset": rollout_id}, (k, rollout_id)
        resumed_from.append(last)
        if finished:
            break
        k += 1
    assert k >= 6 and resumed_from[0] == 0 and resumed_from[-1] == 1  # both outcomes were reached
    # the order of the completed save's writes: the trainer's files, then the writer's four, `latest` last
    tail = [r.split("/")[-1] for r in renamed[-4:]]
    assert tail == [ckpt.ROLLOUT_STATE, ckpt.META, MANIFEST, ckpt.LATEST], renamed
    with open(os.path.join(ckpt.iter_dir(save, 1), ckpt.META)) as f:
        assert json.load(f) == {"rollout_id": 1, "weight_version": "2", "world_size": 1}


class ShardedTrainer(NullTrainer):
    """Stands in for the Ray runtime's ranks: writes dist/ files and returns their entries, hashed where written
    (here with xxhash directly, so the writer's own hashing is counted alone)."""

    def save(self, save_dir: str, rollout_id: int) -> ckpt.SavedTrainer:
        d = os.path.join(ckpt.iter_dir(save_dir, rollout_id), ckpt.DIST_DIR)
        os.makedirs(d, exist_ok=True)
        files = {}
        for name, data in (("__0_0.distcp", b"rank0" * 100), ("__1_0.distcp", b"rank1" * 100), (".metadata", b"m")):
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)
            files[f"{ckpt.DIST_DIR}/{name}"] = {"size": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}
        return ckpt.SavedTrainer(files, world_size=2)


def test_the_writer_reuses_the_trainers_hashes_and_keeps_world_size(tmp_path, monkeypatch):
    hashed: list[str] = []
    real = ckpt_integrity.file_digest
    monkeypatch.setattr(ckpt_integrity, "file_digest", lambda path: hashed.append(path) or real(path))
    save = str(tmp_path / "ckpt")
    ckpt.save_checkpoint(save, 3, ShardedTrainer(), {"sample_offset": 3})
    assert sorted(os.path.basename(p) for p in hashed) == [ckpt.META, ckpt.ROLLOUT_STATE]  # no shard re-hashed
    d = ckpt.iter_dir(save, 3)
    verify(d)
    with open(os.path.join(d, ckpt.META)) as f:
        assert json.load(f)["world_size"] == 2
    assert ckpt.find_latest(save) == 3


def test_a_checkpoint_that_verifies_but_cannot_resume_falls_back_with_one_warning(tmp_path, capsys):
    """What a Ray save before the fix left after `kill -9` of the driver: the ranks' manifest and `latest`, but no
    rollout_state.json. --load resumes the previous checkpoint instead of exiting 2."""
    save = str(tmp_path / "ckpt")
    for rollout_id in (0, 1):
        ckpt.save_checkpoint(save, rollout_id, ShardedTrainer(), {"sample_offset": rollout_id})
    d = ckpt.iter_dir(save, 1)
    os.remove(os.path.join(d, ckpt.ROLLOUT_STATE))
    write_manifest(d)  # verifies
    verify(d)
    capsys.readouterr()
    assert ckpt.find_latest(save) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "iter_0000001/rollout_state.json: missing" in err[0] and "iter_0000000" in err[0]
    with open(os.path.join(d, ckpt.ROLLOUT_STATE), "w") as f:
        f.write("[1, 2]")  # present, parses, but not a rollout state
    write_manifest(d)
    assert ckpt.find_latest(save) == 0
    assert "rollout_state.json: not a JSON object" in capsys.readouterr().err


def test_a_ray_checkpoint_under_the_local_runtime_says_what_it_is(tiny_ckpt, addition_data, tmp_path):
    save = str(tmp_path / "ckpt")
    ckpt.save_checkpoint(save, 0, ShardedTrainer(), {})
    trainer = make_actor(tiny_ckpt, addition_data, tmp_path / "o")
    with pytest.raises(ConfigError) as e:
        trainer.load(save, ckpt.find_latest(save))
    msg = str(e.value)
    assert "saved by --runtime ray's 2 trainer ranks" in msg and "--runtime ray" in msg
    assert "--debug-rollout-only" not in msg


def test_a_sharded_checkpoint_without_dcp_metadata_falls_back(tmp_path, capsys):
    """A Ray checkpoint whose manifest verifies but whose dist/ lacks torch.distributed.checkpoint's .metadata (seen
    once after a rank was killed mid-sync with --async-save): --load resumes the previous checkpoint instead of the
    ranks failing in load with FileNotFoundError."""
    save = str(tmp_path / "ckpt")
    for rollout_id in (0, 1):
        ckpt.save_checkpoint(save, rollout_id, ShardedTrainer(), {"sample_offset": rollout_id})
    d = ckpt.iter_dir(save, 1)
    os.remove(os.path.join(d, ckpt.DIST_DIR, ".metadata"))
    write_manifest(d)  # verifies
    verify(d)
    capsys.readouterr()
    assert ckpt.find_latest(save) == 0
    assert "iter_0000001/dist/.metadata: missing" in capsys.readouterr().err
