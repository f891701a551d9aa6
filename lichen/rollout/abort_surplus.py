"""Dynamic-sampling rounds over engine servers that stop generating once enough groups are kept.

With server engines (RemoteEngines) a round sends all its requests at once and decides the groups in prompt
order, each as soon as all its samples are back: scored, overlong penalty applied, filtered. When the round has
kept the `need` groups the step still lacks, the requests of every later group are surplus: they are cancelled
(those still queued are never sent) and the engines abort what they are running (`/abort_request
{"abort_all": true}`; nothing else runs on them during a rollout step), so no engine time goes to samples nobody
trains on. The groups kept are exactly the ones the generate-everything path keeps — the first passing groups in
prompt order — and their samples are the same (same requests, same seeds); only the groups after the cut are not
generated (counted as aborted). Deciding in prompt order, not in completion order, is what keeps a run
reproducible and its resume exact.

With --partial-rollout (lichen.rollout.partial) the groups after the cut are not thrown away: round 0 may start
with groups resumed from the data source's PartialBuffer (only their unfinished samples are sent, as continuations),
and at the cut the requests still queued are not sent (a gate of our own holds every request beyond the
engines' concurrency caps), the running ones are aborted (`abort_all`, repeated until each has answered, so a
request that reached a server just after an abort is aborted too) and every group after the cut, with what it
has generated so far, goes back into the buffer in prompt order.

The in-process engine generates a round as one batch call and has nothing to abort; custom generate functions
(`--custom-generate-function-path`) make their own engine calls. Both keep the generate-everything path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import TYPE_CHECKING, Any

from lichen.engines.api.engine_protocol import AbortableEngine
from lichen.engines.clients.client import EngineError
from lichen.engines.core.engine import GenResult
from lichen.engines.core.sampler import derive_seed
from lichen.observe.metrics import get_logger
from lichen.rollout.context import RolloutContext
from lichen.rollout.filters import run_group_filter
from lichen.rollout.partial import PartialBuffer, continuation_request, extend_sample, to_buffered
from lichen.rollout.samples import make_sample, sample_requests, score, shape
from lichen.types import Sample

if TYPE_CHECKING:
    from lichen.config.rollout_config import RolloutConfig

log = get_logger(__name__)


def can_abort(cfg: RolloutConfig, engine: Any) -> bool:
    """Rounds stop early only over engines lichen can abort, and only for requests lichen itself makes."""
    return (
        all(hasattr(engine, a) for a in ("agenerate", "submit", "abort_all")) and not cfg.custom_generate_function_path
    )


def generate_round(
    ctx: RolloutContext,
    prompts: list,
    *,
    seed_key: int,
    group_filter: Any,
    need: int,
    resumed: list[list[Sample]] = (),
    buffer: PartialBuffer | None = None,
) -> tuple[list[list[Sample]], list[bool], dict]:
    """One round: (groups decided, keep flag per group, stats). Stats: reward_time_s, failed, aborted_groups,
    aborted_requests, buffered_groups. Groups after the `need`-th kept one are aborted and not returned; with a
    `buffer` (--partial-rollout) they are put into it. `resumed` groups (from the buffer) take positions
    0..len(resumed)-1 of the round, before `prompts`."""
    cfg, sampling = ctx.config, ctx.config.sampling
    resumed = list(resumed)
    fresh, owners = sample_requests(sampling, prompts, ctx.encode, seed_key=seed_key, first_pos=len(resumed))
    # plan[pos] = per sample (request index or None, ("resumed", Sample) or ("fresh", owner))
    requests, plan = [], []
    for pos, group in enumerate(resumed):
        members = []
        for j, s in enumerate(group):
            req = continuation_request(sampling, s, seed=derive_seed(sampling.seed, seed_key, pos, j))
            if req is not None:
                requests.append(req)
            members.append((len(requests) - 1 if req is not None else None, ("resumed", s)))
        plan.append(members)
    for k, owner in enumerate(owners):
        if owner[1] == 0:
            plan.append([])
        requests.append(fresh[k])
        plan[-1].append((len(requests) - 1, ("fresh", owner)))

    engine = ctx.engine
    gate = Gate(engine) if buffer is not None else None
    futures = [engine.submit(gate.generate(r) if gate else engine.agenerate(r, allow_abort=True)) for r in requests]
    groups: list[list[Sample]] = []
    keep: list[bool] = []
    stats = {"reward_time_s": 0.0, "failed": [], "aborted_groups": 0, "aborted_requests": 0, "buffered_groups": 0}
    try:
        for members in plan:
            if sum(keep) >= need:
                break
            mine = [futures[k] for k, _ in members if k is not None]
            concurrent.futures.wait(mine)
            results = [None if k is None else futures[k].result() for k, _ in members]
            if any(res is not None and res.finish_reason == "abort" for res in results):
                # not by us: as the default path, an error
                raise EngineError("an engine aborted a rollout request of a group being kept")
            group = [member_sample(ctx, base, res, False) for (_, base), res in zip(members, results)]
            scored = score(ctx, group)
            stats["reward_time_s"] += scored["reward_time_s"]
            stats["failed"] += scored.get("failed", [])
            shape(cfg, group)
            groups.append(group)
            keep += run_group_filter(group_filter, ctx.args, [group], cfg.dynamic_sampling_filter_path)
    except BaseException:
        _cancel_surplus(engine, futures)
        raise
    if gate is None:
        stats["aborted_requests"] = _cancel_surplus(engine, futures)
    else:
        stats["aborted_requests"] = drain(engine, futures, gate)
        for members in plan[len(groups) :]:
            results = [None if k is None else result_or_none(futures[k]) for k, _ in members]
            buffer.put([member_sample(ctx, base, res, True) for (_, base), res in zip(members, results)])
        stats["buffered_groups"] = len(plan) - len(groups)
    stats["aborted_groups"] = len(plan) - len(groups)
    if stats["aborted_groups"]:
        log.info(
            "dynamic sampling: %d groups kept; aborted the %d requests of the %d later groups of this round%s",
            need,
            stats["aborted_requests"],
            stats["aborted_groups"],
            " (their groups go to the partial-rollout buffer)" if gate is not None else "",
        )
    return groups, keep, stats


def member_sample(ctx: RolloutContext, base: tuple, res: GenResult | None, cut: bool) -> Sample:
    """The Sample of one group member: `base` is ("resumed", buffered Sample) or ("fresh", owner of
    sample_requests); `res` its engine result (None: not sent); `cut`: its group goes to the partial buffer."""
    kind, what = base
    if kind == "resumed":
        mask = ctx.config.mask_offpolicy_in_partial_rollout
        return what if res is None else extend_sample(what, res, _decoder(ctx.tokenizer), mask_offpolicy=mask)
    n = ctx.config.sampling.n_samples_per_prompt
    if res is None:  # cut off before it was sent: a sample with no response yet
        return to_buffered(make_sample(ctx.tokenizer, what, GenResult([], [], "abort", len(what[4]), ""), n), None)
    s = make_sample(ctx.tokenizer, what, res, n)
    return to_buffered(s, res.finish_reason) if cut else s


def _decoder(tokenizer: Any):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def _cancel_surplus(engine: AbortableEngine, futures: list) -> int:
    """Cancel what has not answered (a request still queued for a slot is never sent) and abort the rest on
    the servers; returns how many requests that was."""
    surplus = [f for f in futures if not f.done()]
    if surplus:
        # All cancelled in one step of the engines' loop: cancelled one by one from this thread, the loop could end a
        # running request's slot before a queued request of the same engine was cancelled, and send that one.
        engine.submit(_cancel_all(surplus)).result()
        engine.abort_all()  # the ones running on the servers stop there
    return len(surplus)


async def _cancel_all(futures: list) -> None:
    for f in futures:
        f.cancel()


class Gate:
    """Holds requests beyond the engines' concurrency caps on our side, so that after the cut they are never
    sent (inside the client's own queue they could not be told apart from requests already running)."""

    def __init__(self, engine: AbortableEngine):
        self._engine = engine
        clients = getattr(engine, "clients", None) or []
        self.capacity = sum(getattr(c, "concurrency", 0) for c in clients) or 1 << 30
        self.cut = False
        self._slots: asyncio.Semaphore | None = None

    async def generate(self, request) -> GenResult | None:
        if self._slots is None:  # made on the engines' loop, by the first request (no await before: no race)
            self._slots = asyncio.Semaphore(self.capacity)
        async with self._slots:
            if self.cut:
                return None
            return await self._engine.agenerate(request, allow_abort=True)


def drain(engine: AbortableEngine, futures: list, gate: Gate, poll: float = 0.25) -> int:
    """After the cut: no further request is sent, and the running ones are aborted until every one has answered
    (one that reached its server just after an abort call is caught by the next). Returns how many were open."""
    gate.cut = True
    pending = {f for f in futures if not f.done()}
    open_at_cut = len(pending)
    while pending:
        engine.abort_all()
        _, pending = concurrent.futures.wait(pending, timeout=poll)
    return open_at_cut


def result_or_none(future) -> GenResult | None:
    """A surplus request's result; one that failed (e.g. its engine died) adds nothing and is sent again when its
    group is continued."""
    try:
        return future.result()
    except Exception as e:  # noqa: BLE001 - a cut-off request must not fail the step
        log.warning("a cut-off rollout request failed (%s); its sample is continued next step", e)
        return None
