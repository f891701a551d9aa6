"""Checkpoint integrity (issue 13 "Checkpoints", issue 12 item 8): checksums of every file, verified by --load with a
fallback to the newest intact checkpoint or exit 2; stale temp entries removed on the next save; every .pt file
read with weights_only=True, so a crafted pickle never runs."""

import json
import os
import shutil
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from helpers.runs import base_args, run

from lichen.cli import main
from lichen.errors import ConfigError, UserError
from lichen.loop import NullTrainer
from lichen.train import checkpoint as ckpt
from lichen.train.ckpt_integrity import MANIFEST, remove_stale_temps, verify, write_manifest

COMMON = ["--micro-batch-size", "2", "--save-interval", "1"]


@pytest.fixture(scope="module")
def saved(tiny_ckpt, addition_data, tmp_path_factory) -> str:
    """Two checkpoints (iter_0000000, iter_0000001) of a 2-step run; tests damage copies of them."""
    root = tmp_path_factory.mktemp("saved")
    run(base_args(tiny_ckpt, addition_data, root / "out", "--num-rollout", "2", "--save", str(root / "c"), *COMMON))
    return str(root / "c")


@pytest.fixture
def copy(saved, tmp_path) -> str:
    dst = str(tmp_path / "c")
    shutil.copytree(saved, dst)
    return dst


def flip_bit_in_first_tensor(path: str) -> None:
    """Flip the top exponent bit of the first float32 of a safetensors file (a weight of ~0.1 becomes ~3e37)."""
    with open(path, "r+b") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        name = next(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32")
        at = 8 + header_len + header[name]["data_offsets"][0] + 3  # little-endian: byte 3 holds sign + exponent
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x40]))


def truncate(path: str, size: int = 1000) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def same_size_edit(path: str) -> None:
    text = open(path).read()
    open(path, "w").write(text.replace("0", "1") if "0" in text else text[::-1])


DAMAGE = {
    "truncated safetensors": ("hf/model.safetensors", truncate),
    "empty trainer_state.pt": ("trainer_state.pt", lambda p: open(p, "w").close()),
    "bad rollout_state.json": ("rollout_state.json", lambda p: open(p, "w").write('{"sour')),
    "rollout_state.json edited in place": ("rollout_state.json", same_size_edit),
    "one bit flipped in a weight": ("hf/model.safetensors", flip_bit_in_first_tensor),
    "meta.json deleted": ("meta.json", os.remove),
}


def test_every_file_is_checksummed_and_trainer_state_is_plain_data(saved):
    d = ckpt.iter_dir(saved, 1)
    listed = json.load(open(os.path.join(d, MANIFEST)))["files"]
    assert {"hf/model.safetensors", "hf/config.json", "trainer_state.pt", "rollout_state.json", "meta.json"} <= set(
        listed
    )
    state = torch.load(os.path.join(d, "trainer_state.pt"), weights_only=True)  # refused numpy's state before
    assert state["format"] == ckpt.STATE_FORMAT and isinstance(state["rng"]["numpy"]["keys"], torch.Tensor)
    verify(d)


def test_rng_state_round_trips_through_plain_data():
    np.random.seed(3)
    np.random.normal()  # leaves a cached gaussian in numpy's state
    state = ckpt.rng_state()
    expected = (np.random.rand(4), torch.rand(4))
    np.random.seed(99)
    torch.manual_seed(99)
    ckpt.set_rng_state(state)
    assert np.array_equal(np.random.rand(4), expected[0]) and torch.equal(torch.rand(4), expected[1])


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_with_a_warning(copy, case, capsys):
    rel, damage = DAMAGE[case]
    damage(os.path.join(ckpt.iter_dir(copy, 1), rel))
    assert ckpt.find_latest(copy) == 0
    err = capsys.readouterr().err
    assert "WARNING" in err and f"iter_0000001/{rel}" in err and "iter_0000000" in err


def test_bad_latest_file_resumes_the_newest_intact_checkpoint(copy, capsys):
    open(os.path.join(copy, ckpt.LATEST), "w").write("x1")
    assert ckpt.find_latest(copy) == 1
    assert ckpt.LATEST in capsys.readouterr().err
    open(os.path.join(copy, ckpt.LATEST), "wb").write(b"\xff\xfe")
    assert ckpt.find_latest(copy) == 1


def test_latest_naming_a_missing_checkpoint_falls_back(copy, capsys):
    open(os.path.join(copy, ckpt.LATEST), "w").write("7")
    assert ckpt.find_latest(copy) == 1
    assert "iter_0000007: missing" in capsys.readouterr().err


def test_no_latest_file(copy, capsys):
    os.remove(os.path.join(copy, ckpt.LATEST))
    assert ckpt.find_latest(copy) == 1  # finished checkpoints (checksums written) are still found
    for i in (0, 1):
        os.remove(os.path.join(ckpt.iter_dir(copy, i), MANIFEST))
    assert ckpt.find_latest(copy) is None  # only unfinished saves: a fresh start, as before any checkpoint
    assert "starting from --hf-checkpoint" in capsys.readouterr().err


def test_a_file_added_to_hf_is_damage(copy):
    shutil.copy(
        os.path.join(ckpt.iter_dir(copy, 1), "hf", "config.json"),
        os.path.join(ckpt.iter_dir(copy, 1), "hf", "model.safetensors.index.json"),
    )
    assert ckpt.find_latest(copy) == 0


def test_checkpoint_without_checksums_is_refused_with_what_to_do(copy):
    """An older lichen's checkpoint (no checksums.json; its trainer_state.pt pickled numpy) is never loaded."""
    for i in (0, 1):
        os.remove(os.path.join(ckpt.iter_dir(copy, i), MANIFEST))
    with pytest.raises(ConfigError) as e:
        ckpt.find_latest(copy)
    msg = str(e.value)
    assert "have no checksums.json" in msg and "before checkpoint checksums" in msg
    assert f"--hf-checkpoint {ckpt.iter_dir(copy, 1)}/hf" in msg


def resume_argv(tiny_ckpt, addition_data, tmp_path, load_dir, num_rollout="3"):
    return base_args(
        tiny_ckpt,
        addition_data,
        tmp_path / "resumed",
        "--num-rollout",
        num_rollout,
        "--load",
        load_dir,
        "--micro-batch-size",
        "2",
    )


def test_resume_via_cli_falls_back_to_the_previous_checkpoint(tiny_ckpt, addition_data, tmp_path, copy, capsys):
    flip_bit_in_first_tensor(os.path.join(ckpt.iter_dir(copy, 1), "hf", "model.safetensors"))
    rows = run(resume_argv(tiny_ckpt, addition_data, tmp_path, copy) + ["--save", copy, "--save-interval", "1"])
    assert [m["step"] for m in rows] == [2, 3]  # resumed after iter_0000000: rollout 1 ran again
    err = capsys.readouterr().err
    assert "iter_0000001/hf/model.safetensors: checksum mismatch" in err and "Traceback" not in err
    verify(ckpt.iter_dir(copy, 1))  # saved again over the damaged one
    assert ckpt.find_latest(copy) == 2


def test_resume_after_a_crash_mid_save(tiny_ckpt, addition_data, tmp_path, copy, capsys):
    """The state kill -9 leaves while rollout 1 is being saved: `latest` still names iter_0000000, iter_0000001 has
    no checksums, a half-written trainer_state.pt and the dead saver's hf.tmp-PID/."""
    d = ckpt.iter_dir(copy, 1)
    open(os.path.join(copy, ckpt.LATEST), "w").write("0")
    os.remove(os.path.join(d, MANIFEST))
    truncate(os.path.join(d, "trainer_state.pt"))
    tmp = os.path.join(d, f"hf.tmp-{dead_pid()}")
    shutil.copytree(os.path.join(d, "hf"), tmp)
    truncate(os.path.join(tmp, "model.safetensors"))
    rows = run(resume_argv(tiny_ckpt, addition_data, tmp_path, copy) + ["--save", copy, "--save-interval", "1"])
    assert [m["step"] for m in rows] == [2, 3]
    assert "!!!" not in capsys.readouterr().err  # nothing damaged: the unfinished save is simply not used
    assert not os.path.exists(tmp)
    verify(d)
    assert ckpt.find_latest(copy) == 2


@pytest.mark.parametrize("case", ["one bit flipped in a weight", "empty trainer_state.pt"])
def test_resume_via_cli_exits_2_when_no_checkpoint_is_intact(tiny_ckpt, addition_data, tmp_path, copy, capsys, case):
    rel, damage = DAMAGE[case]
    for i in (0, 1):
        damage(os.path.join(ckpt.iter_dir(copy, i), rel))
    assert main(resume_argv(tiny_ckpt, addition_data, tmp_path, copy)) == 2
    err = capsys.readouterr().err
    assert "no intact checkpoint" in err and f"iter_0000000/{rel}" in err and f"iter_0000001/{rel}" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


class RunsCode:
    """A pickle payload: unpickling it calls exec(), which creates the marker file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


@pytest.mark.parametrize("reseal", [False, True], ids=["checksums-catch-it", "weights-only-refuses-it"])
def test_pickle_payload_in_trainer_state_never_runs(tiny_ckpt, addition_data, tmp_path, copy, capsys, reseal):
    marker = str(tmp_path / "pwned")
    for i in (0, 1):  # both checkpoints: no intact one to fall back to
        d = ckpt.iter_dir(copy, i)
        torch.save({"format": ckpt.STATE_FORMAT, "optimizer": RunsCode(marker)}, os.path.join(d, "trainer_state.pt"))
        if reseal:  # an attacker who also rewrites checksums.json: weights_only=True is what stops the payload
            write_manifest(d)
    assert main(resume_argv(tiny_ckpt, addition_data, tmp_path, copy)) == 2
    err = capsys.readouterr().err
    assert not os.path.exists(marker)
    assert ("refused: it names exec" if reseal else "iter_0000001/trainer_state.pt: truncated or overwritten") in err
    assert "Traceback" not in err


def test_pickle_payload_in_a_debug_rollout_dump_never_runs(tiny_ckpt, addition_data, tmp_path, capsys):
    marker = str(tmp_path / "pwned")
    dump = str(tmp_path / "dump_{rollout_id}.pt")
    torch.save({"rollout_id": 0, "samples": [[RunsCode(marker)]]}, dump.format(rollout_id=0))
    argv = base_args(tiny_ckpt, addition_data, tmp_path / "r", "--num-rollout", "1", "--load-debug-rollout-data", dump)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert not os.path.exists(marker) and "--load-debug-rollout-data" in err and "refused" in err
    assert "Traceback" not in err


def test_pickle_payload_in_critic_pt_never_runs(tmp_path):
    marker = str(tmp_path / "pwned")
    torch.save({"model": RunsCode(marker)}, tmp_path / "critic.pt")
    with pytest.raises(UserError, match="refused"):
        ckpt.read_critic_state(str(tmp_path))  # refused before any state reaches the critic
    assert not os.path.exists(marker)


def test_debug_rollout_dump_of_non_plain_metadata_loads_with_weights_only(tmp_path, capsys):
    import datetime
    from types import SimpleNamespace

    from lichen.rollout.manager import ReplayRollout, dump_rollout
    from lichen.types import Sample, Status

    meta = {"score": np.float32(0.5), "ids": np.arange(3), "when": datetime.date(2026, 1, 2), "status": Status.FAILED}
    sample = Sample(
        prompt=[{"role": "user", "content": "1+1="}],
        tokens=[1, 2, 3],
        response_length=1,
        reward=1.0,
        status=Status.COMPLETED,
        loss_mask=[1],
        metadata=meta,
    )
    path = dump_rollout(str(tmp_path / "d_{rollout_id}.pt"), 0, [[sample]])
    data = torch.load(path, weights_only=True)
    assert data["samples"][0][0]["metadata"] == {
        "score": 0.5,
        "ids": [0, 1, 2],
        "when": "2026-01-02",
        "status": "failed",
    }
    assert "metadata.when (date)" in capsys.readouterr().err
    replay = ReplayRollout(
        SimpleNamespace(
            load_debug_rollout_data=str(tmp_path / "d_{rollout_id}.pt"), reward=SimpleNamespace(reward_key=None)
        )
    )  # what it reads of RolloutConfig
    groups, _ = replay.generate(0)
    assert groups[0][0].tokens == [1, 2, 3] and groups[0][0].status == Status.COMPLETED


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_temp_entries_are_removed_on_the_next_save_but_not_a_live_runs(tmp_path):
    save = tmp_path / "c"
    d = save / "iter_0000000"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # started before its entry
    try:
        stale = [d / f"hf.tmp-{dead_pid()}", d / f"hf.old-{dead_pid()}", d / f"hf.tmp-{os.getpid()}"]
        kept = d / f"hf.tmp-{live.pid}"
        for p in [*stale, kept]:
            (p / "sub").mkdir(parents=True)
            (p / "sub" / "model.safetensors").write_bytes(b"\0" * 1024)
        stale_file = save / f"{ckpt.LATEST}.tmp-{dead_pid()}"
        stale_file.write_text("3")
        # The same live pid on an entry last modified long before that process started: a reused pid, stale.
        reused = save / "iter_0000009" / f"hf.tmp-{live.pid}"
        reused.mkdir(parents=True)
        os.utime(reused, (time.time() - 3600, time.time() - 3600))
        ckpt.save_checkpoint(str(save), 1, NullTrainer(), {"source": {}})
        assert not any(p.exists() for p in [*stale, stale_file, reused])
        assert kept.exists()  # a live run's write in progress is never touched
        assert "hf.tmp" not in json.dumps(json.load(open(ckpt.iter_dir(str(save), 1) + "/" + MANIFEST)))
        assert remove_stale_temps(str(save)) == []
    finally:
        live.kill()
        live.wait()


def test_a_crashed_save_leaves_no_manifest(copy):
    """Re-saving into an existing checkpoint drops its checksums first: a crash mid-save cannot look complete."""
    ckpt.begin_save(copy, 1)  # the save of rollout 1 starts again, then "crashes"
    assert not os.path.exists(os.path.join(ckpt.iter_dir(copy, 1), MANIFEST))
    assert ckpt.find_latest(copy) == 0


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "ends early"),
        (b"PK\x03\x04" + b"\0" * 40, "damaged or not a torch file (RuntimeError"),
        (b'{"a": 1}', "damaged or not a torch file (Unsupported operand"),
    ],
    ids=["empty", "broken zip", "json"],
)
def test_load_plain_names_the_damage(tmp_path, content, message):
    from lichen.torch_files import UnreadableFile, load_plain

    (tmp_path / "x.pt").write_bytes(content)
    with pytest.raises(UnreadableFile) as e:
        load_plain(str(tmp_path / "x.pt"), "state")
    assert str(e.value).startswith(f"state {tmp_path / 'x.pt'}: ") and message in str(e.value)


def test_checkpoint_without_trainer_state_or_critic_is_a_clear_error(tiny_ckpt, addition_data, tmp_path, copy, capsys):
    # GRPO checkpoints hold no critic.pt: resuming them under PPO names what is missing
    assert main(resume_argv(tiny_ckpt, addition_data, tmp_path, copy) + ["--advantage-estimator", "ppo"]) == 2
    err = capsys.readouterr().err
    assert "has no critic.pt" in err and "Traceback" not in err
    for i in (0, 1):  # what --debug-rollout-only saves: no hf/, no trainer_state.pt
        d = ckpt.iter_dir(copy, i)
        shutil.rmtree(os.path.join(d, "hf"))
        os.remove(os.path.join(d, "trainer_state.pt"))
        write_manifest(d)
    assert main(resume_argv(tiny_ckpt, addition_data, tmp_path, copy)) == 2
    err = capsys.readouterr().err
    assert "--debug-rollout-only" in err and "Traceback" not in err


def test_load_dir_that_does_not_exist_yet_is_a_fresh_start(tmp_path):
    """--load naming the --save directory of a run that has not saved yet (the config allows it): no checkpoint,
    not a FileNotFoundError traceback."""
    from lichen.train.checkpoint import find_latest

    assert find_latest(str(tmp_path / "not-yet")) is None
