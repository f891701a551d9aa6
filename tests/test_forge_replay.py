"""--load-forge-rollout-data (slime's forge replay): dumped rollouts are trained on while the launched engine
servers, the weight sync and the offload around it all run.

Real `lichen serve` processes on loopback and real dump files; the first run writes the dumps the second replays.
"""

from __future__ import annotations

import json

import pytest
from helpers.runs import THREADS, base_args, dumped_samples, run

from lichen import sync
from lichen.cli import main
from lichen.errors import DataError
from lichen.rollout.forge_load import forge_path, load_dump
from lichen.torch_files import save_plain


def _engine_args(tmp_path) -> list[str]:
    disk = ["--update-weight-transport", "disk", "--update-weight-disk-dir", str(tmp_path / "w")]
    return ["--num-rollout", "2", "--rollout-num-engines", "1", "--offload-rollout", *THREADS, *disk]


@pytest.mark.slow
def test_forge_replay_trains_on_the_dumped_samples_while_engines_sync(
    tiny_ckpt, addition_data, tmp_path, launched, monkeypatch
):
    dump = str(tmp_path / "a" / "r_{rollout_id}.pt")
    first = run(
        base_args(tiny_ckpt, addition_data, tmp_path / "oa", *_engine_args(tmp_path), "--save-debug-rollout-data", dump)
    )
    versions: list[list] = []  # what the engines report right after each sync of the replaying run
    orig_push = sync.push

    def push(trainer, rollout, version, cfg=None):
        out = orig_push(trainer, rollout, version, cfg)
        versions.append(rollout.engines[0].weight_versions())
        return out

    monkeypatch.setattr(sync, "push", push)  # the loop calls sync.push through the module
    replayed = str(tmp_path / "b" / "r_{rollout_id}.pt")
    # other prompts: a run that generated instead of replaying could not produce the first run's samples
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"prompt": f"{a}*{a}=", "label": str(a * a)}) + "\n" for a in range(64)))
    second = run(
        base_args(
            tiny_ckpt,
            str(other),
            tmp_path / "ob",
            *_engine_args(tmp_path),
            "--load-forge-rollout-data",
            dump,
            "--save-debug-rollout-data",
            replayed,
        )
    )
    for step in range(2):
        # the rollout returned exactly the dumped samples (rewards, log-probs, weight versions included) ...
        assert dumped_samples(replayed.format(rollout_id=step)) == dumped_samples(dump.format(rollout_id=step))
        # ... and training on them is training as the first run did (same weights, same samples)
        assert second[step]["train/loss"] == pytest.approx(first[step]["train/loss"], abs=1e-6)
        assert second[step]["sync/weight_version"] == step + 1
    assert versions == [["0"], ["1"], ["2"]]  # the live engine took every weight version
    assert len(launched) == 2  # each run started its engine server ...
    assert not any(launched[1].alive())  # ... and stopped it


def _dump(path, groups) -> str:
    save_plain({"rollout_id": 0, "samples": groups}, str(path))
    return str(path)


def test_forge_paths_follow_slimes_convention(tmp_path):
    literal = _dump(tmp_path / "only.pt", [])
    assert forge_path(literal, 5) == literal  # one file for every step
    template = str(tmp_path / "r_{rollout_id}.pt")
    zero = _dump(tmp_path / "r_0.pt", [])
    one = _dump(tmp_path / "r_1.pt", [])
    assert forge_path(template, 1) == one
    assert forge_path(template, 7) == zero  # a step without a file replays step 0's
    with pytest.raises(DataError, match=r"no dump for rollout 3 .* nor the step-0 file"):
        forge_path(str(tmp_path / "none_{rollout_id}.pt"), 3)


def test_forge_dumps_are_checked(tmp_path):
    flat = [{"tokens": [1, 2], "response_length": 1, "group_index": g, "status": "completed"} for g in (0, 0, 1)]
    groups = load_dump(_dump(tmp_path / "flat.pt", flat), "--load-forge-rollout-data")
    assert [len(g) for g in groups] == [2, 1]  # slime's flat list, regrouped by prompt
    for bad, message in (
        ({"samples": 3}, "not a rollout dump"),
        ({"samples": [[1]]}, "group 0 is not a list of sample dicts"),
        ({"samples": [[{"status": "exploded"}]]}, "group 0 holds a sample lichen cannot read"),
    ):
        save_plain(bad, str(tmp_path / "bad.pt"))
        with pytest.raises(DataError, match=message):
            load_dump(str(tmp_path / "bad.pt"), "--load-forge-rollout-data")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--load-debug-rollout-data", "x_{rollout_id}.pt"], "--load-forge-rollout-data and --load-debug-rollout-data"),
        (["--debug-rollout-only"], "exclude each other"),
        (["--rollout-function-path", "loop_plugins.constant_rollout"], "drop --rollout-function-path"),
    ],
)
def test_forge_flag_conflicts_are_usage_errors(tiny_ckpt, addition_data, tmp_path, capsys, extra, message):
    dump = _dump(tmp_path / "d.pt", [])
    argv = base_args(tiny_ckpt, addition_data, tmp_path / "o", "--load-forge-rollout-data", dump, *extra)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_forge_literal_path_must_exist(tiny_ckpt, addition_data, tmp_path, capsys):
    argv = base_args(tiny_ckpt, addition_data, tmp_path / "o", "--load-forge-rollout-data", str(tmp_path / "no.pt"))
    assert main(argv) == 2
    assert "--load-forge-rollout-data" in capsys.readouterr().err
