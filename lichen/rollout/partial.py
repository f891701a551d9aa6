"""Partial rollout (`--partial-rollout`): groups cut off by an abort are continued next step, not thrown away.

With dynamic sampling over engine servers, a round stops once it has kept the groups the step lacks, and the
requests of the later groups are aborted (lichen.rollout.abort_surplus). With --partial-rollout each such group
goes, in prompt order, into the `PartialBuffer` of the rollout data source (lichen.rollout.data_source):
  - a sample that had already finished (stop / length) is kept as it is;
  - an aborted sample keeps its partial response, its rollout log-probs and the weight version it was made with;
  - a request that was never sent leaves a sample with no response tokens (status pending).

Next step the buffered groups come first in round 0, before new prompts (the rollout takes that many fewer
prompts from the data source, so its position stays exact), and only their unfinished samples are continued:

    input_ids      = prompt ids + response tokens so far
    max_new_tokens = --rollout-max-response-len - response tokens so far
    seed           = derive_seed(--seed, seed key of the round, group position in the round, j)

The continuation's tokens and log-probs are appended. A sample's response is a list of segments, one per
generation that added tokens: `weight_versions[i]` made `metadata["partial_rollout_segments"][i]` tokens (the
segment lengths sum to response_length). A group then is scored and filtered like any other.

`--mask-offpolicy-in-partial-rollout`: loss_mask[t] = 0 for every response token t of a segment whose weight
version differs from the last segment's (the version that finished the sample), else 1. Without it, every
response token has loss_mask 1.

The buffer is saved in every checkpoint (`RolloutDataSource.state_dict`), Samples as plain dicts, so a resumed run
continues the same groups with the same requests and seeds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from lichen.engines.core.engine import GenRequest, GenResult
from lichen.engines.core.sampler import truncates
from lichen.errors import ConfigError
from lichen.rollout.messages import PARTIAL_NEEDS_SERVERS, PARTIAL_WITH_CUSTOM_GENERATE
from lichen.rollout.trajectory import add_engine
from lichen.types import Sample, Status

if TYPE_CHECKING:
    from lichen.config.rollout_config import RolloutConfig

SEGMENTS_KEY = "partial_rollout_segments"  # metadata: response tokens per weight_versions entry
_STATE_VERSION = 1
_FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


class PartialBuffer:
    """Groups of samples cut off by an abort, oldest first, waiting to be continued."""

    def __init__(self) -> None:
        self._groups: list[list[Sample]] = []

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def groups(self) -> list[list[Sample]]:
        return list(self._groups)

    def put(self, group: list[Sample]) -> None:
        self._groups.append(list(group))

    def take_all(self) -> list[list[Sample]]:
        """Every buffered group, in the order they were put; the buffer is empty afterwards."""
        out, self._groups = self._groups, []
        return out

    def clear(self) -> None:
        self._groups = []

    def num_tokens(self) -> int:
        """Response tokens held (generated already, reused when continued)."""
        return sum(s.response_length for g in self._groups for s in g)

    def state_dict(self) -> dict:
        return {"version": _STATE_VERSION, "groups": [[s.to_dict() for s in g] for g in self._groups]}

    def load_state_dict(self, state: dict | None) -> None:
        """Restore the groups of `state_dict()`; None (a checkpoint from before partial rollout) is empty."""
        if not state:
            self._groups = []
            return
        self._groups = [[Sample.from_dict(d) for d in g] for g in state.get("groups", [])]


def require_abortable(cfg: RolloutConfig, can_abort: bool) -> None:
    """--partial-rollout needs dynamic sampling over engines whose requests lichen can abort (cfg: RolloutConfig)."""
    if not cfg.partial_rollout:
        return
    if cfg.custom_generate_function_path:
        raise ConfigError(PARTIAL_WITH_CUSTOM_GENERATE)
    if not can_abort:
        raise ConfigError(PARTIAL_NEEDS_SERVERS)


def segments_of(sample: Sample) -> list[int]:
    """Response tokens per weight_versions entry; a sample never buffered is one segment."""
    segs = sample.metadata.get(SEGMENTS_KEY)
    if segs is None:
        return [sample.response_length] if sample.response_length else []
    return list(segs)


def offpolicy_loss_mask(segments: list[int], versions: list[str], mask_offpolicy: bool) -> list[int]:
    """Per response token: 0 when masking and its segment's version is not the last segment's, else 1."""
    if len(segments) != len(versions):
        raise ValueError(f"{len(segments)} response segments but {len(versions)} weight versions")
    if not mask_offpolicy or not versions:
        return [1] * sum(segments)
    last = versions[-1]
    return [int(v == last) for seg, v in zip(segments, versions) for _ in range(seg)]


def is_unfinished(sample: Sample) -> bool:
    return sample.status in (Status.PENDING, Status.ABORTED)


def continuation_request(sampling: Any, sample: Sample, *, seed: int) -> GenRequest | None:
    """The request that continues `sample` under `sampling` (a SamplingConfig; None: it is finished).

    A sample whose response already fills --rollout-max-response-len is marked truncated instead."""
    if not is_unfinished(sample):
        return None
    budget = sampling.response_budget(len(sample.tokens), sampling.max_response_len - sample.response_length)
    if budget <= 0:
        sample.status = Status.TRUNCATED
        return None
    return GenRequest(
        input_ids=list(sample.tokens),
        max_new_tokens=budget,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        stop_token_ids=list(sampling.stop_token_ids),
        seed=seed,
        return_sampling_mask=truncates(sampling.top_p, sampling.top_k),
    )


def to_buffered(sample: Sample, finish: str | None) -> Sample:
    """A new sample of a cut-off group (made from its engine result; `finish` None: the request was never sent
    and `sample` has no response) in the form the buffer holds: status and one segment per weight version."""
    sample.status = Status.PENDING if finish is None else _FINISH_STATUS[finish]
    if sample.response_length:
        sample.metadata[SEGMENTS_KEY] = [sample.response_length]
    else:
        sample.metadata[SEGMENTS_KEY] = []
        sample.weight_versions = []
    return sample


def extend_sample(
    sample: Sample, res: GenResult, decode: Callable[[list[int]], str], *, mask_offpolicy: bool
) -> Sample:
    """A copy of buffered `sample` with the continuation `res` appended as a new segment (none when `res` has no
    tokens), its status from res's finish reason and its loss mask recomputed (see `offpolicy_loss_mask`)."""
    out = Sample.from_dict(sample.to_dict())
    segments = segments_of(out)
    new = list(res.output_ids)
    if new:
        out.tokens = list(out.tokens) + new
        out.rollout_log_probs = list(out.rollout_log_probs or []) + list(res.output_logprobs)
        # kept sets only when every segment has them (else the trainer scores the full vocabulary)
        had = out.rollout_sampling_mask is not None or not out.response_length
        new_sets = res.sampling_mask
        out.rollout_sampling_mask = (out.rollout_sampling_mask or []) + new_sets if had and new_sets else None
        out.weight_versions = list(out.weight_versions) + [res.weight_version]
        add_engine(out.metadata, res.engine)
        out.response_length += len(new)
        segments.append(len(new))
        out.response = decode(out.response_tokens)
    out.metadata[SEGMENTS_KEY] = segments
    out.status = _FINISH_STATUS[res.finish_reason]
    out.loss_mask = offpolicy_loss_mask(segments, out.weight_versions, mask_offpolicy)
    return out
