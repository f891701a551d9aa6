"""Crafted checkpoint directories (issue 33): files are read only as regular files inside the checkpoint, capped, so
a planted symlink cannot make a message reveal another file's size, and a `latest` (or manifest, or listed file)
that is a FIFO, /dev/zero or /proc/self/pagemap neither hangs the load nor fills its memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from lichen.errors import ConfigError
from lichen.train import checkpoint as ckpt
from lichen.train.ckpt_integrity import ALGORITHM, MANIFEST, write_manifest

SECRET_SIZE = 12345


def iter_with(load_dir, rollout_id: int, manifest_files: dict) -> str:
    d = ckpt.iter_dir(str(load_dir), rollout_id)
    os.makedirs(os.path.join(d, "hf"))
    with open(os.path.join(d, MANIFEST), "w") as f:
        json.dump({"format": 1, "algorithm": ALGORITHM, "files": manifest_files}, f)
    return d


def test_a_planted_link_does_not_reveal_the_size_of_its_target(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * SECRET_SIZE)
    load = tmp_path / "c"
    d = iter_with(load, 1, {"hf/model.safetensors": {"size": 1, ALGORITHM: "0" * 32}})
    os.symlink(secret, os.path.join(d, "hf", "model.safetensors"))
    (load / ckpt.LATEST).write_text("1")
    with pytest.raises(ConfigError) as e:
        ckpt.find_latest(str(load))
    assert str(SECRET_SIZE) not in str(e.value)
    assert "hf/model.safetensors: a link that leads outside its directory" in str(e.value)


def test_a_symlinked_checkpoint_directory_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "x").write_text("x")
    write_manifest(str(elsewhere))  # an intact checkpoint, but not one saved into this directory
    load = tmp_path / "c"
    load.mkdir()
    os.symlink(elsewhere, ckpt.iter_dir(str(load), 3))
    (load / ckpt.LATEST).write_text("3")
    with pytest.raises(ConfigError, match="iter_0000003: a symlink, not a directory a save wrote"):
        ckpt.find_latest(str(load))


def test_links_inside_the_checkpoint_still_verify(tmp_path):
    load = tmp_path / "c"
    d = ckpt.iter_dir(str(load), 0)
    os.makedirs(os.path.join(d, "hf"))
    with open(os.path.join(d, "hf", "a.bin"), "wb") as f:
        f.write(b"abc")
    for name in (ckpt.ROLLOUT_STATE, ckpt.META):  # what a resume needs besides the trainer's files
        with open(os.path.join(d, name), "w") as f:
            f.write("{}")
    write_manifest(d)
    (load / ckpt.LATEST).write_text("0\n")
    assert ckpt.find_latest(str(load)) == 0
    (load / ckpt.LATEST).unlink()
    # a link inside the directory is followed (a regular file, read capped): not a rollout id, so the newest intact
    # checkpoint is used, with a warning
    os.symlink(os.path.join(d, "hf", "a.bin"), load / ckpt.LATEST)
    assert ckpt._read_latest(str(load)) == (None, f"{ckpt.LATEST}: holds 'abc', not a rollout id")
    assert ckpt.find_latest(str(load)) == 0


# Each case runs in a child with a 2 GiB address-space limit and a timeout: without the fix the FIFO blocks the
# open forever, /dev/zero and /proc/self/pagemap are read until memory runs out.
CHILD = textwrap.dedent(
    """
    import resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    from lichen.errors import ConfigError
    from lichen.train import checkpoint as ckpt
    try:
        if sys.argv[2] == "rollout_state":
            ckpt.load_rollout_state(sys.argv[1], 0)
        else:
            ckpt.find_latest(sys.argv[1])
    except ConfigError as e:
        print("ConfigError:", e)
    """
)


def special(kind: str, tmp_path) -> str:
    if kind == "fifo":
        path = str(tmp_path / "fifo")
        os.mkfifo(path)
        return path
    return {"zero": "/dev/zero", "pagemap": "/proc/self/pagemap"}[kind]


@pytest.mark.parametrize("where", ["latest", "manifest", "listed", "rollout_state"])
@pytest.mark.parametrize("kind", ["fifo", "zero", "pagemap"])
@pytest.mark.slow
def test_special_files_neither_hang_nor_exhaust_memory(tmp_path, kind, where):
    load = tmp_path / "c"
    d = ckpt.iter_dir(str(load), 0)
    os.makedirs(d)
    target = special(kind, tmp_path)
    if where == "latest":
        os.symlink(target, load / ckpt.LATEST)
    elif where == "manifest":
        os.symlink(target, os.path.join(d, MANIFEST))
    elif where == "listed":
        os.symlink(target, os.path.join(d, "w.bin"))
        with open(os.path.join(d, MANIFEST), "w") as f:  # lists the file with size 0, as /dev/zero's stat says
            json.dump({"format": 1, "algorithm": ALGORITHM, "files": {"w.bin": {"size": 0, ALGORITHM: "0"}}}, f)
    else:
        os.symlink(target, os.path.join(d, ckpt.ROLLOUT_STATE))
    if where in ("manifest", "listed"):
        (load / ckpt.LATEST).write_text("0")  # named, so a damaged checkpoint is an error, not a fresh start
    if kind == "fifo" and where != "latest":  # a FIFO planted inside the directory itself, no link needed
        link = {"manifest": MANIFEST, "listed": "w.bin", "rollout_state": ckpt.ROLLOUT_STATE}[where]
        os.unlink(os.path.join(d, link))
        os.mkfifo(os.path.join(d, link))
    out = subprocess.run([sys.executable, "-c", CHILD, str(load), where], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ConfigError:"), (out.stdout, out.stderr[-2000:])
    assert "not a regular file" in out.stdout or "leads outside its directory" in out.stdout, out.stdout
