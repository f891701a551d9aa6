"""The sandbox's uid-slot lock directory (lichen/rewards/sandbox_lease.py, issue 33 item 5): it is trusted only
when private to this user, and no lock file is opened through a symlink. The attacks: a directory another user
made first (mode 0777, or owned by them), a symlinked directory, a symlinked lock file."""

from __future__ import annotations

import os
import stat
import tempfile

import pytest

from lichen.rewards.sandbox_lease import SLOTS, LockDirUnsafe, UidLease, lock_dir_path

BASE = 2_000_000_000
OTHER_UID = 65534


@pytest.fixture
def tmp(tmp_path, monkeypatch):
    """A private tmp standing in for /tmp (tempfile.gettempdir() reads tempfile.tempdir first)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_the_directory_is_made_private_and_leases_are_exclusive(tmp):
    a, b = UidLease(BASE), UidLease(BASE)
    assert a.try_take() and b.try_take() and a.uid != b.uid
    st = os.lstat(lock_dir_path())
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    lock = os.path.join(lock_dir_path(), f"lichen-sandbox-{a.uid}.lock")
    assert stat.S_IMODE(os.lstat(lock).st_mode) == 0o600
    a.release()
    b.release()


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o750, 0o701])
def test_a_directory_open_to_others_is_refused(tmp, mode):
    os.mkdir(lock_dir_path())
    os.chmod(lock_dir_path(), mode)
    with pytest.raises(LockDirUnsafe, match=f"{lock_dir_path()} has mode {mode & 0o7777:04o}.*rm -rf"):
        UidLease(BASE).try_take()
    assert os.listdir(lock_dir_path()) == []  # not one lock file made in it


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory owned by another uid needs root")
def test_a_directory_owned_by_another_user_is_refused(tmp):
    os.mkdir(lock_dir_path(), 0o700)
    os.chown(lock_dir_path(), OTHER_UID, OTHER_UID)
    with pytest.raises(LockDirUnsafe, match=f"is owned by uid {OTHER_UID}, not {os.geteuid()}"):
        UidLease(BASE).try_take()
    assert os.listdir(lock_dir_path()) == []


def test_a_symlinked_directory_is_refused(tmp):
    elsewhere = tmp / "attacker-dir"
    elsewhere.mkdir(mode=0o700)
    os.symlink(elsewhere, lock_dir_path())
    with pytest.raises(LockDirUnsafe, match="is a symlink"):
        UidLease(BASE).try_take()
    assert os.listdir(elsewhere) == []


def test_symlinked_lock_files_are_refused_and_their_targets_not_made(tmp):
    os.mkdir(lock_dir_path(), 0o700)
    target = tmp / "victim" / "made-by-root"
    target.parent.mkdir()
    for k in range(SLOTS):  # every slot, so whichever slot the lease tries first is one
        os.symlink(target, os.path.join(lock_dir_path(), f"lichen-sandbox-{BASE + k}.lock"))
    with pytest.raises(LockDirUnsafe, match=r"lichen-sandbox-\d+\.lock is a symlink; remove it"):
        UidLease(BASE).try_take()
    assert not target.exists() and not os.path.lexists(target)


def test_a_lock_file_that_is_not_a_regular_file_is_refused(tmp):
    os.mkdir(lock_dir_path(), 0o700)
    for k in range(SLOTS):
        os.mkfifo(os.path.join(lock_dir_path(), f"lichen-sandbox-{BASE + k}.lock"))
    with pytest.raises(LockDirUnsafe, match="not a regular file"):
        UidLease(BASE).try_take()
