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

The in-process engine generates a round as one batch call and has nothing to abort; custom generate functions
(`--custom-generate-function-path`) make their own engine calls. Both keep the generate-everything path.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

from lichen.engines.client import EngineError
from lichen.observe.metrics import get_logger
from lichen.rewards import score_samples
from lichen.rollout.filters import run_group_filter
from lichen.rollout.shaping import apply_overlong_penalty
from lichen.types import Sample

log = get_logger(__name__)


def can_abort(args: Any, manager: Any) -> bool:
    engine = manager.engine
    return (all(hasattr(engine, a) for a in ("agenerate", "submit", "abort_all"))
            and not getattr(args, "custom_generate_function_path", None))


def generate_round(args: Any, manager: Any, prompts: list, *, seed_key: int, group_filter: Any, path: str,
                   need: int) -> tuple[list[list[Sample]], list[bool], dict]:
    """One round: (groups decided, keep flag per group, stats). Stats: reward_time_s, failed, aborted_groups,
    aborted_requests. Groups after the `need`-th kept one are aborted and not returned."""
    from lichen.rollout.generate import make_sample, sample_requests

    n = args.n_samples_per_prompt
    requests, owners = sample_requests(args, manager, prompts, n=n, temperature=args.rollout_temperature,
                                       top_p=args.rollout_top_p, top_k=args.rollout_top_k,
                                       max_new_tokens=args.rollout_max_response_len, seed_key=seed_key)
    engine = manager.engine
    futures = [engine.submit(engine.agenerate(r, allow_abort=True)) for r in requests]
    by_group: list[list[int]] = [[] for _ in prompts]
    for k, owner in enumerate(owners):
        by_group[owner[0]].append(k)
    groups: list[list[Sample]] = []
    keep: list[bool] = []
    stats = {"reward_time_s": 0.0, "failed": [], "aborted_groups": 0, "aborted_requests": 0}
    try:
        for pos, members in enumerate(by_group):
            if sum(keep) >= need:
                break
            concurrent.futures.wait([futures[k] for k in members])
            results = [futures[k].result() for k in members]
            if any(res.finish_reason == "abort" for res in results):  # not by us: as the default path, an error
                raise EngineError("an engine aborted a rollout request of a group being kept")
            group = [make_sample(manager, owners[k], res, n) for k, res in zip(members, results)]
            t0 = time.perf_counter()
            scored = score_samples(group, manager.reward_fn, args)
            stats["reward_time_s"] += scored.get("reward_time_s", time.perf_counter() - t0)
            stats["failed"] += scored.get("failed", [])
            buffer_len = getattr(args, "overlong_buffer_len", None)
            if buffer_len is not None:
                apply_overlong_penalty(group, max_response_len=args.rollout_max_response_len, buffer_len=buffer_len,
                                       factor=args.overlong_penalty_factor, reward_key=args.reward_key)
            groups.append(group)
            keep += run_group_filter(group_filter, args, [group], path)
    finally:
        surplus = [f for f in futures if not f.done()]
        for f in surplus:
            f.cancel()  # a request still queued for a slot is never sent
        if surplus:
            engine.abort_all()  # the ones running on the servers stop there
        stats["aborted_groups"] = len(prompts) - len(groups)
        stats["aborted_requests"] = len(surplus)
    if stats["aborted_groups"]:
        log.info("dynamic sampling: %d groups kept; aborted the %d requests of the %d later groups of this round",
                 need, len(surplus), stats["aborted_groups"])
    return groups, keep, stats
