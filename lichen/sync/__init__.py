"""Weight sync: publishing the trainer's weights to the engines (DESIGN §1, §2).

`push` is the only path from trainer to engines. The in-process engine gets a direct tensor copy; server
transports (distributed broadcast, disk full/delta) come with the server engines. After every push the engines
must report the version just published — a stale engine is an error, not a warning.
"""

from __future__ import annotations

import time


class StaleEngineError(RuntimeError):
    pass


def push(trainer, rollout, version: int) -> dict:
    """Publish the trainer's current weights as weight version `version` to every engine of `rollout`.

    A trainer without weights (the null trainer of --debug-rollout-only) or a rollout without engines (the
    replay of --debug-train-only) makes this a no-op.
    """
    engines = list(getattr(rollout, "engines", []))
    named = getattr(trainer, "named_weights", None)
    if not engines or named is None:
        return {}
    t0 = time.perf_counter()
    for engine in engines:
        engine.update_weights_from_tensors(named(), str(version))
    stale = [i for i, e in enumerate(engines) if e.weight_version != str(version)]
    if stale:
        raise StaleEngineError(f"engines {stale} did not take weight version {version}")
    return {"time/sync": time.perf_counter() - t0, "sync/weight_version": version}
