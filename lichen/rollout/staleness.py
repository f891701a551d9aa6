"""How many weight versions a sample is behind the trainer (`--async`, `--fully-async`, docs/async.md).

A sample's lag is the trainer's version before the step that trains it minus the oldest weight version of its
response segments (`Sample.weight_versions`); versions that are not step numbers (an external server's
"default") are skipped. A group's lag is its oldest sample's.
"""

from __future__ import annotations

from lichen.types import Sample


def sample_lag(sample: Sample, trainer_version: int) -> int | None:
    versions = [int(v) for v in sample.weight_versions if str(v).lstrip("-").isdigit()]
    return trainer_version - min(versions) if versions else None


def group_lag(group: list[Sample], trainer_version: int) -> int | None:
    lags = [lag for lag in (sample_lag(s, trainer_version) for s in group) if lag is not None]
    return max(lags) if lags else None


def staleness_metrics(batch: list[list[Sample]], trainer_version: int) -> dict:
    """train/staleness_mean and train/staleness_max over the samples of `batch` ({} when none has a version)."""
    lags = [lag for lag in (sample_lag(s, trainer_version) for g in batch for s in g) if lag is not None]
    if not lags:
        return {}
    return {"train/staleness_mean": sum(lags) / len(lags), "train/staleness_max": max(lags)}
