"""Evaluation: per-data-set metrics (mean reward, unbiased pass@k, truncation ratio) and the eval pass itself.

Metrics of one data set (groups = the samples of each prompt), logged as `eval/<name>/<metric>`:
- reward_mean: mean scalar reward over samples whose verifier did not fail;
- pass@k for k = 1, 2, 4, ... < n and k = n, where n = the fewest samples any prompt has: the mean over prompts of
  the unbiased estimator  pass@k = 1 - C(n - c, k) / C(n, k)  (c = correct samples of that prompt among its first
  n; a sample is correct when it did not fail and its scalar reward is > 0);
- truncated_ratio: share of samples cut by the response-length limit;
- response_length_mean, num_failed, num_samples, num_prompts.
"""

from __future__ import annotations

import time
from math import comb
from typing import Any

from lichen.types import Sample, Status


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt with n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def pass_k_values(n: int) -> list[int]:
    """1, 2, 4, ... below n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n] if n >= 1 else []


def is_correct(sample: Sample, reward_key: str | None) -> bool:
    return sample.status != Status.FAILED and sample.scalar_reward(reward_key) > 0


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
    n = min(len(g) for g in groups) if groups else 0
    for k in pass_k_values(n):
        vals = [pass_at_k(n, sum(is_correct(s, reward_key) for s in g[:n]), k) for g in groups]
        out[f"pass@{k}"] = sum(vals) / len(vals)
    return out


def load_eval_sets(args: Any) -> dict:
    """name -> (resolved data-set config, prompt records), for every eval data set of `args`."""
    from lichen.data import load_prompt_dataset

    out = {}
    for cfg in _dataset_configs(args):
        records = load_prompt_dataset(
            cfg["path"], input_key=cfg["input_key"], label_key=cfg["label_key"],
            metadata_key=cfg["metadata_key"], tool_key=cfg["tool_key"], flag=f"eval data set {cfg['name']!r}",
        )
        out[cfg["name"]] = (cfg, records)
    return out


def _dataset_configs(args: Any) -> list[dict]:
    configs = getattr(args, "eval_dataset_configs", None)
    if configs is not None:
        return configs
    # args that did not pass through config validation (e.g. built by hand): the flags alone
    from lichen.config.eval import flag_level

    base = flag_level(args)
    return [{**base, "name": name, "path": path} for name, path in (getattr(args, "eval_datasets", None) or [])]


def build_eval_reward_fns(args: Any, eval_sets: dict, default_fn: Any) -> dict:
    """name -> reward function; data sets with the training reward share `default_fn`, others share by type."""
    from lichen.rewards import build_reward_fn

    cache: dict = {(getattr(args, "rm_type", None), getattr(args, "custom_rm_path", None)): default_fn}
    out = {}
    for name, (cfg, _) in eval_sets.items():
        key = (cfg["rm_type"], cfg["custom_rm_path"])
        if key not in cache:
            cache[key] = build_reward_fn(cfg["rm_type"], cfg["custom_rm_path"], args)
        out[name] = cache[key]
    return out


def run_eval(manager: Any, version: int) -> dict:
    """Generate and score every eval data set with its own settings; returns `eval/<name>/<metric>` metrics."""
    from lichen.models.tokenizer import encode_prompt
    from lichen.rewards import score_samples
    from lichen.rollout.generate import build_samples

    args = manager.args
    out: dict = {}
    t0 = time.perf_counter()
    reward_time = 0.0
    cache = manager.__dict__.setdefault("_eval_encoded", {})
    for name, (cfg, records) in manager.eval_sets.items():

        class _View:  # what build_samples reads of a manager, with this data set's prompt encoding
            tokenizer, engine = manager.tokenizer, manager.engine

            @staticmethod
            def encode(i: int, record: Any, _name: str = name, _chat: bool = cfg["apply_chat_template"]) -> list:
                key = (_name, i)
                if key not in cache:
                    cache[key] = encode_prompt(manager.tokenizer, record.prompt, _chat, record.tools)
                return cache[key]

        groups = build_samples(
            args, _View, list(enumerate(records)), n=cfg["n_samples_per_eval_prompt"],
            temperature=cfg["temperature"], top_p=cfg["top_p"], top_k=cfg["top_k"],
            max_new_tokens=cfg["max_response_len"], seed_key=-1,
        )
        stats = score_samples([s for g in groups for s in g], manager.eval_reward_fns[name], args)
        reward_time += stats["reward_time_s"]
        for key, value in eval_metrics(groups, cfg["reward_key"]).items():
            out[f"eval/{name}/{key}"] = value
    out["time/eval"] = time.perf_counter() - t0
    out["time/eval_reward"] = reward_time
    return out
