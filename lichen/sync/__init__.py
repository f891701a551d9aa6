"""Weight sync: publishing the trainer's weights to the engines (DESIGN §1, §2).

`push` is the only path from trainer to engines. The in-process engine gets a direct tensor copy; server
engines (lichen serve / SGLang, `engine.is_remote`) get the transport chosen by --update-weight-transport:
today full disk sync (lichen.sync.disk); the distributed broadcast and delta modes come with the Weight sync
issue (the flag check refuses them first). After every push the engines must report the version just
published — a stale engine is an error, not a warning.
"""

from __future__ import annotations

import time

from lichen.errors import NotAvailableYet


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
    if any(getattr(e, "is_remote", False) for e in engines):
        return _push_to_servers(trainer, rollout.args, engines, version)
    t0 = time.perf_counter()
    for engine in engines:
        engine.update_weights_from_tensors(named(), str(version))
    stale = [i for i, e in enumerate(engines) if e.weight_version != str(version)]
    if stale:
        raise StaleEngineError(f"engines {stale} did not take weight version {version}")
    return {"time/sync": time.perf_counter() - t0, "sync/weight_version": version}


def _push_to_servers(trainer, args, engines: list, version: int) -> dict:
    transport, mode = args.update_weight_transport, args.update_weight_mode
    if transport == "disk" and mode == "full":
        from lichen.sync.disk import push_full

        return push_full(trainer, engines, version, disk_dir=args.update_weight_disk_dir,
                         hf_checkpoint=args.hf_checkpoint, keep_files=args.update_weight_disk_keep_files)
    # lichen.config.sync refuses these before anything starts; this guards direct callers.
    raise NotAvailableYet(f"--update-weight-transport {transport} --update-weight-mode {mode} to server engines is "
                          "not available yet; use --update-weight-transport disk --update-weight-mode full")
