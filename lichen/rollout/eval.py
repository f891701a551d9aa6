"""Evaluation: per-data-set metrics (mean reward, unbiased pass@k, truncation ratio) and lichen's eval function.

Metrics of one data set (groups = the samples of each prompt), logged as `eval/<name>/<metric>`:
- reward_mean: mean scalar reward over samples whose verifier did not fail;
- pass@k for k = 1, 2, 4, ... <= n (powers of two, as slime), where n = the fewest samples any prompt has: the mean
  over prompts of the unbiased estimator  pass@k = 1 - C(n - c, k) / C(n, k)  (c = correct samples of that prompt
  among its first n; a sample is correct when it did not fail and its scalar reward is exactly 1, as slime:
  partial credit such as a code pass fraction of 0.5 is not a pass);
- truncated_ratio: share of samples cut by the response-length limit;
- response_length_mean, num_failed, num_samples, num_prompts;
- of multi-turn tool trajectories (`tool_use_metrics`, also logged as `rollout/<metric>`): tool_call_ratio,
  tool_calls_mean, turns_mean and, when --check-token-fidelity ran, token_fidelity_mismatch_ratio.
"""

from __future__ import annotations

from math import comb
from typing import Any

from lichen.data import load_prompt_dataset
from lichen.rewards import build_reward_fn
from lichen.rollout.base_types import RolloutFnEvalOutput
from lichen.rollout.context import current
from lichen.rollout.samples import build_samples, score
from lichen.types import Sample, Status


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt with n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def pass_k_values(n: int) -> list[int]:
    """1, 2, 4, ... up to n (slime's rungs: n itself only when it is a power of two)."""
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return ks


def is_correct(sample: Sample, reward_key: str | None) -> bool:
    return sample.status != Status.FAILED and sample.scalar_reward(reward_key) == 1


def eval_metrics(groups: list[list[Sample]], reward_key: str | None) -> dict:
    """Metrics over groups of samples of one data set (see the module docstring)."""
    samples = [s for g in groups for s in g]
    scored = [s for s in samples if s.status != Status.FAILED]
    out = {
        "reward_mean": sum(s.scalar_reward(reward_key) for s in scored) / max(len(scored), 1),
        "truncated_ratio": sum(s.status == Status.TRUNCATED for s in samples) / max(len(samples), 1),
        "response_length_mean": sum(s.response_length for s in samples) / max(len(samples), 1),
        "num_failed": len(samples) - len(scored),
        "num_samples": len(samples),
        "num_prompts": len(groups),
    }
    out.update(tool_use_metrics(samples))
    n = min(len(g) for g in groups) if groups else 0
    for k in pass_k_values(n):
        vals = [pass_at_k(n, sum(is_correct(s, reward_key) for s in g[:n]), k) for g in groups]
        out[f"pass@{k}"] = sum(vals) / len(vals)
    return out


def tool_use_metrics(samples: list[Sample]) -> dict:
    """Over the samples a tool rollout made (those with metadata["tool_calls"]; none: no metric): the share that
    called a tool at least once, the mean number of calls and of engine turns per sample, and the share whose token
    history differs from apply_chat_template of their conversation (only when the fidelity check ran). Whether a
    policy learns to use its tools is what agentic RL is about, so the rate is logged at every step and eval."""
    traj = [s for s in samples if isinstance((s.metadata or {}).get("tool_calls"), list)]
    if not traj:
        return {}
    n = len(traj)
    out = {
        "tool_call_ratio": sum(bool(s.metadata["tool_calls"]) for s in traj) / n,
        "tool_calls_mean": sum(len(s.metadata["tool_calls"]) for s in traj) / n,
        "turns_mean": sum(s.metadata.get("turns") or 0 for s in traj) / n,
    }
    checked = [s for s in traj if "token_fidelity" in s.metadata]
    if checked:
        out["token_fidelity_mismatch_ratio"] = sum(s.metadata["token_fidelity"] is not None for s in checked) / len(
            checked
        )
    return out


def load_eval_sets(configs: tuple[dict, ...] | list[dict], max_row_bytes: int | None = None) -> dict:
    """name -> (resolved data-set config, prompt records), for every resolved eval data set config (JSONL rows
    over `max_row_bytes` dropped unread)."""
    out = {}
    for cfg in configs:
        records = load_prompt_dataset(
            cfg["path"],
            input_key=cfg["input_key"],
            label_key=cfg["label_key"],
            metadata_key=cfg["metadata_key"],
            tool_key=cfg["tool_key"],
            flag=f"eval data set {cfg['name']!r}",
            max_row_bytes=max_row_bytes,
        )
        out[cfg["name"]] = (cfg, records)
    return out


def build_eval_reward_fns(reward: Any, eval_sets: dict, default_fn: Any) -> dict:
    """name -> reward function; data sets with the training reward (`reward`: a RewardConfig) share `default_fn`,
    others share by type."""
    cache: dict = {(reward.rm_type, reward.custom_rm_path): default_fn}
    out = {}
    for name, (cfg, _) in eval_sets.items():
        key = (cfg["rm_type"], cfg["custom_rm_path"])
        if key not in cache:
            cache[key] = build_reward_fn(cfg["rm_type"], cfg["custom_rm_path"], reward, group=reward.group_rm)
        out[name] = cache[key]
    return out


def eval_rollout(args: Any, rollout_id: int, data_source: Any) -> RolloutFnEvalOutput:
    """lichen's eval function (`generate_rollout(..., evaluation=True)`): every eval data set generated with its own
    sampling settings and scored with its own reward. `rollout_id` is the weight version evaluated; the training
    `data_source` is not used (the eval sets come from lichen.rollout.context.current())."""
    ctx = current()
    ctx.rollout_id = rollout_id
    data: dict = {}
    reward_time = 0.0
    for name, (cfg, records) in ctx.eval_sets.items():
        groups = build_samples(
            ctx,
            list(enumerate(records)),
            ctx.config.sampling.for_eval(cfg),
            seed_key=-1,
            encode=lambda i, record, _name=name: ctx.encode(i, record, dataset=_name),
        )
        samples = [s for g in groups for s in g]
        reward_time += score(ctx, samples, ctx.eval_reward_fns[name], evaluation=True)["reward_time_s"]
        data[name] = {
            "samples": groups,
            "rewards": [s.scalar_reward(cfg["reward_key"]) for s in samples],
            "truncated": [s.status == Status.TRUNCATED for s in samples],
        }
    return RolloutFnEvalOutput(data, {"time/eval_reward": reward_time})


def eval_output_metrics(data: dict, reward_keys: dict) -> dict:
    """`eval/<name>/<metric>` for every data set of an eval output's `data` (`reward_keys`: name -> reward key).
    A data set's samples may come flat: they are grouped by group_index."""
    out = {}
    for name, entry in data.items():
        groups = _as_groups(entry["samples"])
        for key, value in eval_metrics(groups, reward_keys.get(name)).items():
            out[f"eval/{name}/{key}"] = value
    return out


def _as_groups(samples: list) -> list[list[Sample]]:
    if not samples or isinstance(samples[0], list):
        return samples
    groups: dict = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s)
    return list(groups.values())
