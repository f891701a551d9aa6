"""One Ray instance per test process, shared by the Ray test modules.

A Ray start costs seconds of a 2-core machine, and most Ray tests only need their actors to fit: `shared_ray()`
starts a local instance (8 declared CPUs and GPUs, no dashboard, a 100 MB object store) on first use and keeps it
for the rest of the session (Ray's own exit hook stops it). A module that needs a Ray of its own (another
environment for the workers, several nodes, lichen's own start) calls `own_ray()` first, which stops the shared
one; the next `shared_ray()` starts it again.
"""

from __future__ import annotations

import os

SHARED_OPTIONS = dict(
    address="local",
    num_cpus=8,
    num_gpus=8,
    include_dashboard=False,
    object_store_memory=100 * 1024 * 1024,
    log_to_driver=False,
)
_state = {"shared": False}  # whether the Ray this process has initialized is the shared one


def shared_ray() -> None:
    """Make the shared instance the one this process is connected to."""
    import ray

    if ray.is_initialized() and _state["shared"]:
        return
    if ray.is_initialized():
        ray.shutdown()
    # Ray's workers inherit this process's environment: a LICHEN_TEST_* variable that another test's local run put
    # there (--train-env-vars applies to the trainer's own process) would show up in every actor.
    for key in [k for k in os.environ if k.startswith("LICHEN_TEST_")]:
        del os.environ[key]
    ray.init(**SHARED_OPTIONS)
    _state["shared"] = True


def own_ray() -> None:
    """Stop whatever Ray this process is connected to, before a test starts one of its own."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    _state["shared"] = False
