"""--runtime ray: a `launch` line of the engine control file adds an engine actor mid-run (RayEngineSet.add;
docs/fault-tolerance.md#engines-come-and-go).

A 3-step run on the shared Ray instance (8 declared GPUs) with one `lichen serve` engine actor on the run's
placement group and --use-fault-tolerance. At step 1 the rollout plug-in appends `launch` to <output>/engines.add
and waits (on a condition, bounded) until the pool has added the engine: a new actor outside the placement group,
on a whole GPU Ray found free, pending until the next weight sync. Step 1's metrics row: engines/added 1,
engines/healthy 1; after step 1's sync the added engine is in rotation (step 2's row: healthy 2), serves the
current version and gets work. The run's end stops it with the others.
"""

from __future__ import annotations

import os
import time

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'lichen[ray]')")

from helpers.ray_local import shared_ray  # noqa: E402
from helpers.runs import base_args, run  # noqa: E402

from lichen.engines.core.engine import GenRequest  # noqa: E402

pytestmark = pytest.mark.e2e  # see the marker in pyproject.toml: make test leaves it to make test-e2e

SEEN: dict = {}  # what the rollout plug-in saw, per step


def _wait(cond, what: str, timeout: float = 300.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def launching_rollout(args, rollout_id, data_source, evaluation=False):
    """Step 1: ask for one more engine and wait until the pool has it. Every step: what the pool looks like."""
    from lichen.rollout.context import current
    from lichen.rollout.generate import generate_rollout

    engines = current().engine
    if rollout_id == 1 and not evaluation:
        with open(os.path.join(args.output_dir, "engines.add"), "a") as f:
            f.write("launch\n")
        _wait(lambda: len(engines.monitor.states) == 2, "the launched engine to join the pool")
        SEEN["added_state"] = engines.monitor.states[1]
        SEEN["gpus"] = [ray.get(a.where.remote(), timeout=120)["cuda_visible_devices"] for a in engines.launcher.actors]
    if rollout_id == 2 and not evaluation:  # after step 1's sync: both engines take requests
        reqs = [GenRequest(input_ids=[i + 1, 2, 3], max_new_tokens=4, seed=i) for i in range(8)]
        results = engines.generate(reqs)
        SEEN["served_by"] = sorted({engines.urls.index(r.engine) for r in results})  # engine URL -> index
        SEEN["versions"] = engines.weight_versions()
    SEEN.setdefault("in_rotation", []).append(list(engines.router.in_rotation()))
    SEEN["launcher"] = engines.launcher
    return generate_rollout(args, rollout_id, data_source, evaluation)


@pytest.mark.slow
def test_a_launch_line_adds_an_engine_actor_mid_run(tiny_ckpt, addition_data, tmp_path):
    shared_ray()
    SEEN.clear()
    ray_run = "--num-rollout 3 --device cpu --num-threads 1 --runtime ray --actor-num-gpus-per-node 1"
    ray_run += " --rollout-num-gpus 1 --use-fault-tolerance --rollout-health-check-interval 0.5"
    ray_run += " --rollout-health-check-timeout 30 --rollout-health-check-first-wait 0"
    # a full version on disk: the added engine loads it at the sync after it joined
    disk = ["--update-weight-transport", "disk", "--update-weight-mode", "full"]
    disk += ["--update-weight-disk-dir", str(tmp_path / "versions")]
    plugin = ["--rollout-function-path", "test_ray_engine_launch.launching_rollout"]
    metrics = run(base_args(tiny_ckpt, addition_data, tmp_path / "out", *ray_run.split(), *disk, *plugin))
    print("seen by the rollout plug-in:", {k: v for k, v in SEEN.items() if k != "launcher"})
    steps = [m for m in metrics if "train/loss" in m]
    assert len(steps) == 3, metrics
    pool = [(m["engines/added"], m["engines/healthy"]) for m in metrics if "engines/added" in m]
    assert pool == [(0.0, 1.0), (1.0, 1.0), (1.0, 2.0)], pool
    assert SEEN["added_state"] == "pending"
    assert SEEN["in_rotation"] == [[0], [0], [0, 1]], SEEN["in_rotation"]
    assert SEEN["served_by"] == [0, 1] and SEEN["versions"] == ["2", "2"], SEEN
    # the added actor holds a GPU of its own, not one of the placement group's
    assert len(SEEN["gpus"]) == 2 and SEEN["gpus"][1] and SEEN["gpus"][1] != SEEN["gpus"][0], SEEN["gpus"]
    actors = SEEN.pop("launcher").actors
    assert len(actors) == 2
    for actor in actors:  # stopped with the others at the end of the run
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.where.remote(), timeout=60)
