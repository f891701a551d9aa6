"""The chaos run's fault injections (scripts/chaos_run.py, tests/test_chaos.py), loaded by dotted path.

Every fault fires at a chosen point of the run, never at a chosen time: the run's trigger directory
($LICHEN_CHAOS_TRIGGERS) holds one file per scheduled fault, `<kind>.<step>`; the plug-in that reaches that point
removes the file first (so that a replayed step, or a rank restarted by a recovery, does not fire it again) and
injects the fault, after appending one line to `injected.log` there. The trainer ranks of a Ray run see this
module and the variable through --train-env-vars.

- rollout (--rollout-function-path, the driver): `engine_kill.<step>` (`ray_engine_kill.<step>` on Ray, where the
  server is its engine actor's child) SIGKILLs engine 0 once it holds a request;
  `slow_engine.<step>` SIGSTOPs engine 1 once it holds one (alive, never answering: the health check's timeout
  finds it, it is restarted and its requests are re-sent).
- corrupt_delta (--custom-update-weight-post-write-path, after a version is written, before the engines pull
  it): `corrupt_delta.<version>` flips one byte of the version's largest file; the engines' checksums find it.
- advantage (--custom-advantage-function-path, every trainer rank): constant advantages 0.25;
  `rank_kill_train.<step>` makes rank 1 SIGKILL itself after the step's first collectives.
- checkpoint (installed by `rollout` as lichen.train.ckpt_async's write hook, in the local runtime's one process):
  `ckpt_kill.<step>` ends the process once step `step`'s checkpoint files are written, before its manifest and
  `latest` (SIGKILL; in a test's in-process run, where a SIGKILL would end the test, an exception no handler of
  lichen's takes, with the same files left on disk).
"""

from __future__ import annotations

import os
import signal

import torch
from helpers.engine_kill import kill_when_busy

TRIGGERS_ENV = "LICHEN_CHAOS_TRIGGERS"
IN_PROCESS_ENV = "LICHEN_CHAOS_IN_PROCESS"  # set by tests/test_chaos.py: the run shares the test's process
LOG = "injected.log"


class Crash(BaseException):
    """A process death inside a test's in-process run: BaseException, so lichen's error handling lets it through."""


def _take(name: str) -> str | None:
    """The trigger directory if trigger `name` was armed (it is removed: it fires once), else None."""
    folder = os.environ.get(TRIGGERS_ENV)
    if not folder:
        return None
    try:
        os.unlink(os.path.join(folder, name))
    except FileNotFoundError:
        return None
    return folder


def note(folder: str, line: str) -> None:
    """Append one line to the run's record of injected faults."""
    with open(os.path.join(folder, LOG), "a") as f:
        f.write(line + "\n")


def checkpoint_hook(stage: str, rollout_id: int) -> None:
    """ckpt_async's write hook: the process dies once step `ckpt_kill.<step>`'s checkpoint files are written."""
    if stage != "files":
        return
    folder = _take(f"ckpt_kill.{rollout_id + 1}")
    if folder is None:
        return
    note(
        folder, f"ckpt_kill step {rollout_id + 1}: the process killed with the checkpoint's files written, no manifest"
    )
    if os.environ.get(IN_PROCESS_ENV):
        raise Crash(f"chaos: killed while saving checkpoint {rollout_id}")
    os.kill(os.getpid(), signal.SIGKILL)


def rollout(args, rollout_id, data_source, evaluation=False):
    """lichen's own rollout, with engine 0 killed or engine 1 hung while it holds requests where scheduled."""
    from lichen.rollout.context import current
    from lichen.rollout.generate import generate_rollout
    from lichen.train import ckpt_async

    ckpt_async.WRITE_HOOK = checkpoint_hook  # the trainer runs in this process (local runtime)

    step = rollout_id + 1
    for kind, index, sig, what in (
        ("engine_kill", 0, signal.SIGKILL, "SIGKILL"),
        ("ray_engine_kill", 0, signal.SIGKILL, "(a Ray engine actor's server) SIGKILL"),
        ("slow_engine", 1, signal.SIGSTOP, "SIGSTOP (hung past the health-check timeout)"),
    ):
        folder = _take(f"{kind}.{step}")
        if folder is None:
            continue
        seen: dict = {}
        killer = kill_when_busy(current().engine, index, seen, sig=sig)
        try:
            return generate_rollout(args, rollout_id, data_source)
        finally:
            killer.join()
            note(folder, f"{kind} step {step}: engine {index} {what} with {seen.get('in_flight_at_kill')} in flight")
    return generate_rollout(args, rollout_id, data_source)


def corrupt_delta(version_dir: str) -> None:
    """Flip one byte in the middle of the largest file of the version just written, where scheduled."""
    name = os.path.basename(os.path.normpath(version_dir))
    version = int(name.rsplit("v", 1)[1]) if name.rsplit("v", 1)[-1].isdigit() else -1
    folder = _take(f"corrupt_delta.{version}")
    if folder is None:
        return
    files = [os.path.join(version_dir, f) for f in os.listdir(version_dir) if f.endswith(".safetensors")]
    victim = max(files, key=os.path.getsize)
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) - 16)  # in the data, past the header
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    note(folder, f"corrupt_delta version {version}: one byte of {os.path.basename(victim)} flipped")


def advantage(args, samples, *, rewards, mask, kl):
    """Advantages 0.25 on every token; on rank 1 of a Ray run, SIGKILL where scheduled (the step is the weight
    version the samples were generated with, plus one: the synchronous loop's numbering)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() == 1:
        step = int(samples[0].weight_versions[0]) + 1
        folder = _take(f"rank_kill_train.{step}")
        if folder is not None:
            note(folder, f"rank_kill_train step {step}: trainer rank 1 SIGKILLed mid-train")
            os.kill(os.getpid(), signal.SIGKILL)
    return torch.full_like(mask, 0.25)
