"""Stopping a run whose every sample fails: `--max-consecutive-failed-steps`.

A failed sample (its verifier raised, timed out or returned an unusable reward) gets zero weight, so a rollout
step in which every sample failed trains on nothing. One such step can be bad luck; several in a row mean the
reward cannot work (a wrong `--rm-type`, labels under another key, a verifier that crashes on every input), and a
run that went on would finish with exit code 0 and `reward 0.000` on every line, having learnt nothing.
"""

from __future__ import annotations

from typing import Iterable

from lichen.errors import RunError
from lichen.types import Sample, Status


class AllSamplesFailed(RunError):
    """Every sample failed in `--max-consecutive-failed-steps` consecutive rollout steps."""


class FailedStepGuard:
    """Counts consecutive rollout steps in which every sample failed; raises AllSamplesFailed at `limit` (0: never)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.streak = 0

    def check(self, rollout_id: int, groups: Iterable[list[Sample]]) -> None:
        samples = [s for g in groups for s in g]
        if not samples or any(s.status != Status.FAILED for s in samples):
            self.streak = 0
            return
        self.streak += 1
        if self.limit and self.streak >= self.limit:
            first = rollout_id + 2 - self.streak  # 1-based step number of the first all-failed step
            example = next((s for s in samples if s.metadata and s.metadata.get("reward_error")), samples[0])
            cause = (example.metadata or {}).get("reward_error", "no cause recorded")
            steps = f"step {rollout_id + 1}" if self.streak == 1 else f"steps {first}-{rollout_id + 1}"
            raise AllSamplesFailed(
                f"every sample failed in {self.streak} consecutive rollout step(s) ({steps}; {len(samples)} samples "
                f"in the last, e.g. sample {example.index}: {cause}): the run trains on nothing. Fix the reward "
                f"(--rm-type / --custom-rm-path, the label key) or the data; --max-consecutive-failed-steps sets "
                f"how many such steps stop a run (0: never)"
            )
