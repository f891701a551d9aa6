"""A weight sync that fails ends the run with one line naming the engine and the weight version, exit code 1.

Real failures, through a launched `lichen serve` engine and disk sync: a post-write hook changes one tensor of the
published checkpoint (the engine then serves other weights: checksum mismatch), or deletes its weights (the
engine refuses the update: an engine error).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))


def corrupt_weights(path: str) -> None:
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1
    save_file(tensors, file, metadata={"format": "pt"})


def remove_weights(path: str) -> None:
    os.remove(os.path.join(path, "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "hook,want",
    [
        ("corrupt_weights", "does not serve the trainer's weights after the sync to version 0: 1 tensor(s) differ"),
        ("remove_weights", "weight sync to version 0 failed: engine http://127.0.0.1:"),
    ],
)
def test_sync_failure_is_one_line_with_engine_and_version(tiny_ckpt, addition_data, tmp_path, hook, want):
    out = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "lichen.cli",
        "train",
        "--hf-checkpoint",
        tiny_ckpt,
        "--prompt-data",
        addition_data,
        "--rm-type",
        "leading_number",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--rollout-max-response-len",
        "4",
        "--num-rollout",
        "1",
        "--output-dir",
        str(out),
        "--no-progress",
        "--rollout-num-engines",
        "1",
        "--update-weight-transport",
        "disk",
        "--update-weight-mode",
        "full",
        "--update-weight-disk-dir",
        str(out / "weights"),
        "--custom-update-weight-post-write-path",
        f"test_sync_errors.{hook}",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, REPO])}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("lichen train: error: ") and want in last, last
    assert "http://127.0.0.1:" in last  # which engine
