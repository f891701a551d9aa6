"""Replaying dumped rollouts: --load-debug-rollout-data (no engines) and --load-forge-rollout-data (engines live).

Both read the files --save-debug-rollout-data writes (lichen.rollout.manager.dump_rollout: `{"rollout_id",
"samples": [[sample dict, ...], ...]}`, one group per prompt; a flat list of sample dicts, as slime dumps them, is
grouped by each sample's `group_index`).

--load-forge-rollout-data is slime's memory-test mode (slime.rollout.forge_load): the rollout function returns the
dumped samples instead of generating, while the engine servers, weight sync and the offload/onload around it all run
as in a real run. Its path follows slime's convention:

- a path without `{rollout_id}` is one file, replayed at every rollout step;
- a template with `{rollout_id}` loads that step's file, and falls back to the file of step 0 when the step has none
  (a memory test often has only `0.pt` but wants several steps); with neither, the step fails naming both paths.

Evaluation differs from slime's: slime replays `eval_<id>` files, lichen evaluates with the live engines as usual
(it writes no eval dumps to replay).
"""

from __future__ import annotations

import os
from typing import Any

from lichen.errors import DataError
from lichen.observe.metrics import get_logger
from lichen.rollout.base_types import RolloutFnTrainOutput
from lichen.torch_files import load_plain
from lichen.types import Sample

log = get_logger(__name__)

FORGE_FLAG = "--load-forge-rollout-data"
ROLLOUT_ID_FIELD = "{rollout_id}"


def load_dump(path: str, flag: str) -> list[list[Sample]]:
    """The groups of Samples in the rollout dump at `path`; anything else is a DataError naming `flag` and file."""
    data = load_plain(path, flag)
    samples = data.get("samples") if isinstance(data, dict) else None
    if not isinstance(samples, list):
        raise DataError(
            f"{flag} {path}: not a rollout dump (no 'samples' list; write one with --save-debug-rollout-data)"
        )
    if all(isinstance(g, dict) for g in samples):  # slime's flat list: regroup by prompt
        by_group: dict[Any, list[dict]] = {}
        for d in samples:
            by_group.setdefault(d.get("group_index", 0), []).append(d)
        samples = list(by_group.values())
    groups: list[list[Sample]] = []
    for gi, group in enumerate(samples):
        if not isinstance(group, list) or not all(isinstance(d, dict) for d in group):
            raise DataError(f"{flag} {path}: group {gi} is not a list of sample dicts")
        try:
            groups.append([Sample.from_dict(d) for d in group])
        except (TypeError, ValueError) as e:  # an unknown status, a field of the wrong kind
            raise DataError(f"{flag} {path}: group {gi} holds a sample lichen cannot read: {e}") from None
    return groups


def forge_path(template: str, rollout_id: int) -> str:
    """The file step `rollout_id` replays under slime's convention (see the module docstring)."""
    if ROLLOUT_ID_FIELD not in template:
        return template
    path = template.format(rollout_id=rollout_id)
    if os.path.isfile(path):
        return path
    fallback = template.format(rollout_id=0)
    if os.path.isfile(fallback):
        log.info("%s: %s missing, replaying %s (slime's fallback to step 0)", FORGE_FLAG, path, fallback)
        return fallback
    raise DataError(f"{FORGE_FLAG}: no dump for rollout {rollout_id} at {path!r}, nor the step-0 file {fallback!r}")


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> RolloutFnTrainOutput:
    """The rollout function of --load-forge-rollout-data: the dumped groups of this step, as generated. The
    samples keep their own indices and weight versions (the trainer's bookkeeping reads them as dumped)."""
    if evaluation:
        raise DataError(f"{FORGE_FLAG} replays training rollouts only; evaluation uses lichen's eval function")
    template = getattr(args, "load_forge_rollout_data", None)
    if not template:
        raise DataError(f"{FORGE_FLAG} is not set: give the dump path (or a {ROLLOUT_ID_FIELD} template)")
    path = forge_path(template, rollout_id)
    groups = load_dump(path, FORGE_FLAG)
    log.info("%s: replaying %d group(s) from %s for rollout %d", FORGE_FLAG, len(groups), path, rollout_id)
    return RolloutFnTrainOutput(samples=groups)
