"""A trainer rank SIGKILLed in the middle of a bucket broadcast under --runtime ray (`nccl` transport, gloo on CPU):
the sync fails with one line naming the rank and the engine, in bounded time, no process of the run is left, and
the next run with --load resumes from the last checkpoint.

The kill is deterministic: LICHEN_TEST_KILL_RANK_IN_BUCKET (lichen.weights.rank_send) makes rank 1 kill itself
inside the K-th bucket it gathers, right after the bucket's first tensor; the ranks gather bucket k+1 while bucket
k is on the wire, so K is chosen as bucket 3 of weight version 2 (the sync after step 2, whose checkpoint is
already written): rank 1 dies while bucket 2 is broadcast."""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'lichen[ray]')")

from helpers.ray_local import shared_ray  # noqa: E402
from helpers.runs import base_args  # noqa: E402

from lichen.cli import main  # noqa: E402
from lichen.observe.metrics import read_metrics  # noqa: E402
from lichen.weights.rank_send import KILL_IN_BUCKET_ENV, plan_meta_buckets, tensor_meta  # noqa: E402
from lichen.weights.wire import GROUP_TIMEOUT_S  # noqa: E402

pytestmark = pytest.mark.e2e  # see the marker in pyproject.toml: make test leaves it to make test-e2e

BUFFER = 64 * 1024  # several tensors per bucket, several buckets per sync
# A failure bound, not a schedule: from step 1's metrics row (written after version 1's sync) to the failed run's
# return there is one tiny step and the failing sync; a run that waited on a collective for the weight group's
# timeout (or the trainer process group's 600 s) would take longer than this.
FAIL_BOUND_S = GROUP_TIMEOUT_S


@pytest.fixture(scope="module")
def ray_local():
    shared_ray()
    yield


def _buckets_per_sync(model_dir: str) -> int:
    """How many buckets the driver plans per sync: the trainer's parameters in order, float32 (lichen serve's
    default dtype, the engine's)."""
    import torch

    from lichen.models import load_model

    model = load_model(model_dir, dtype=torch.float32)
    meta = [tensor_meta(n, p) for n, p in model.named_parameters()]
    return len(plan_meta_buckets(meta, torch.float32, BUFFER))


def _ray_argv(model: str, data: str, out: str, save: str, rollouts: int, *extra: str) -> list[str]:
    return base_args(
        model,
        data,
        out,
        "--runtime",
        "ray",
        "--actor-num-nodes",
        "1",
        "--actor-num-gpus-per-node",
        "2",
        "--rollout-num-gpus",
        "1",
        "--device",
        "cpu",
        "--num-threads",
        "1",
        "--update-weight-transport",
        "nccl",
        "--update-weight-buffer-size",
        str(BUFFER),
        "--save",
        save,
        "--save-interval",
        "1",
        "--num-rollout",
        str(rollouts),
        *extra,
    )


def _processes_of_run(marker: str) -> list[str]:
    """'pid cmdline' of every process of this user whose command line or environment holds `marker` (the run's
    unique model path is in each engine's command line; the kill variable is in each trainer rank's
    environment)."""
    found = []
    me = os.getpid()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == me:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone meanwhile, or another user's
            continue
        if state != "Z" and (marker in cmd or marker in env):
            found.append(f"{pid} {cmd[:120]}")
    return found


def _no_processes_left(marker: str, bound_s: float = 60.0) -> list[str]:
    """The run's processes still alive once they stopped exiting (Ray kills actors asynchronously; `bound_s` is a
    failure bound)."""
    deadline = time.monotonic() + bound_s
    left = _processes_of_run(marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = _processes_of_run(marker)
    return left


@pytest.mark.slow
def test_rank_killed_mid_broadcast_fails_in_one_line_leaves_nothing_and_resumes(
    ray_local, tiny_ckpt, addition_data, tmp_path, capsys
):
    model = str(tmp_path / "model-rank-kill")  # a path of this test alone: it marks the engine's processes
    shutil.copytree(tiny_ckpt, model)
    n = _buckets_per_sync(model)
    assert n >= 3
    # buckets 1..n are version 0's (the sync before step 1), n+1..2n version 1's, then version 2's: its third one,
    # gathered during bucket 2's broadcast
    kill_at = 2 * n + 3
    save = str(tmp_path / "ckpt")
    env = json.dumps({KILL_IN_BUCKET_ENV: f"1:{kill_at}"})

    rc = main(_ray_argv(model, addition_data, str(tmp_path / "o1"), save, 4, "--train-env-vars", env))
    elapsed = time.time() - os.path.getmtime(tmp_path / "o1" / "metrics.jsonl")
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("lichen train: error:")]
    assert rc == 1, err[-2000:]
    assert len(errors) == 1, err[-2000:]
    line = errors[0]
    assert re.fullmatch(
        r"lichen train: error: trainer rank 1 failed in sync_weights\(broadcast\): its actor died \(.*\) "
        rf"\(during bucket 2 of {n} of weight version 2 to engine 0 \(http://127\.0\.0\.1:\d+\)\)",
        line,
    ), line
    assert elapsed < FAIL_BOUND_S, f"{elapsed:.0f} s from step 1's row to the failure: something waited for a timeout"

    # steps 1 and 2 ran; step 2's save comes before its sync, but may still be in flight when the sync fails (an
    # asynchronous checkpoint write is then abandoned): the last checkpoint is rollout 1's or rollout 0's
    assert [r["step"] for r in read_metrics(str(tmp_path / "o1"))] == [1]  # step 2's row follows its sync
    latest = int(open(os.path.join(save, "latest_checkpointed_iteration.txt")).read())
    assert latest in (0, 1)

    # no orphan: no engine server (its command line holds the model path) and no trainer rank (its environment
    # holds the kill variable) outlives the run
    assert _no_processes_left(model) == []
    assert _no_processes_left(KILL_IN_BUCKET_ENV) == []

    # the next run resumes from the last checkpoint: it runs the rollouts after it only
    rc = main(_ray_argv(model, addition_data, str(tmp_path / "o2"), save, 4, "--load", save))
    err = capsys.readouterr().err
    assert rc == 0, err[-2000:]
    assert [r["step"] for r in read_metrics(str(tmp_path / "o2"))] == list(range(latest + 2, 5))
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == "3"
    assert _no_processes_left(model) == []
