"""Turning the children's raw records into per-run summaries, medians over repeats, ratios and a printed table.

Per run, step-level numbers are averaged (and, for times, also the median and minimum taken) over the *timed* steps: all steps but the first when a run has more
than two (the first pays one-time costs: thread pools, allocator growth, lazy initialisation in both
frameworks). Throughputs are ratios of sums over the timed steps (tokens / seconds), not means of ratios.
Tokens:
  - useful rollout tokens: generated response tokens (EOS included, nothing after it);
  - useful positions: p + r - 1 per sequence (see lichen_bench.limits), the positions a forward must run;
  - computed positions: rows x sequence length of every forward the framework actually ran, so left/right
    padding and finished rows kept in the batch count; the trainer's are split into trained ones (forward and
    backward) and no-grad ones (old, reference log-probs).
FLOP/s: "useful" counts the FLOPs of the useful positions (forward, x3 with the backward), the work any framework
must do; it can exceed what the hardware did when a framework computes fewer positions (lichen computes a group's
shared prompt once). The trainer's kernel efficiency is therefore over the positions it computed (the useful
FLOPs per position of the step x (3 x trained + no-grad positions)) / the matmul peak, and the saving from prompt
sharing is its own line: useful / trained positions (above 1: positions not computed; below 1: padding).
"""

from __future__ import annotations

import statistics

from lichen_bench.limits import batch_forward_flops, useful_tokens

# (key, label, unit, format) in print order
METRICS = (
    ("step_time_s", "step time (mean)", "s", "{:.3f}"),
    ("step_time_median_s", "step time (median of steps)", "s", "{:.3f}"),
    ("step_time_min_s", "step time (fastest step, all repeats)", "s", "{:.3f}"),
    ("generate_s", "  generate incl. reward (mean)", "s", "{:.3f}"),
    ("generate_median_s", "  generate (median of steps)", "s", "{:.3f}"),
    ("generate_min_s", "  generate (fastest, all repeats)", "s", "{:.3f}"),
    ("train_s", "  train (mean)", "s", "{:.3f}"),
    ("train_median_s", "  train (median of steps)", "s", "{:.3f}"),
    ("train_min_s", "  train (fastest, all repeats)", "s", "{:.3f}"),
    ("other_s", "  other (mean)", "s", "{:.3f}"),
    ("engine_s", "engine alone", "s", "{:.3f}"),
    ("rollout_tokens_per_s", "useful rollout tok/s (step)", "tok/s", "{:.1f}"),
    ("engine_tokens_per_s", "useful rollout tok/s (engine)", "tok/s", "{:.1f}"),
    ("response_tokens", "response tokens / step", "tok", "{:.1f}"),
    ("engine_useful_positions", "engine useful positions / step", "tok", "{:.0f}"),
    ("engine_computed_positions", "engine computed positions / step", "tok", "{:.0f}"),
    ("train_useful_positions", "train useful positions / step", "tok", "{:.0f}"),
    ("train_computed_positions", "train computed positions / step", "tok", "{:.0f}"),
    ("engine_gflops", "engine useful GFLOP/s", "GFLOP/s", "{:.2f}"),
    ("trainer_gflops", "trainer useful GFLOP/s", "GFLOP/s", "{:.2f}"),
    ("engine_matmul_frac", "engine / matmul peak", "", "{:.3f}"),
    ("trainer_computed_gflops", "trainer computed GFLOP/s", "GFLOP/s", "{:.2f}"),
    ("trainer_computed_matmul_frac", "trainer kernel efficiency (computed / matmul peak)", "", "{:.3f}"),
    ("train_useful_per_trained_position", "useful / trained positions (prompt sharing)", "", "{:.3f}"),
    ("skipped_samples", "zero-advantage backwards skipped / step", "", "{:.1f}"),
    ("reward_mean", "reward (mean over steps)", "", "{:.3f}"),
    ("peak_rss_mib", "peak RSS", "MiB", "{:.0f}"),
    ("wall_s", "process wall time", "s", "{:.1f}"),
    ("cpu_s", "process CPU time (user+sys)", "s", "{:.1f}"),
)


def _timed(steps: list[dict]) -> list[dict]:
    return steps[1:] if len(steps) > 2 else steps


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _div(a, b) -> float | None:
    return a / b if a is not None and b else None


def lichen_steps(child: dict, metrics: list[dict]) -> list[dict]:
    """Join the child's per-step instrumentation with lichen's metrics.jsonl (one record per rollout step)."""
    records = [m for m in metrics if "time/step" in m]
    steps = []
    for i, m in enumerate(records):
        inst = child["steps"][i] if i < len(child.get("steps", [])) else {}
        gen, train, step = m.get("time/generate"), m.get("time/train"), m["time/step"]
        steps.append(
            {
                "step_time": step,
                "generate_time": gen,
                "train_time": train,
                "engine_time": inst.get("engine_time"),
                "reward_mean": m.get("rollout/reward_mean"),
                "lengths": inst.get("lengths") or [],
                "engine_tokens": inst.get("engine_tokens"),
                "train_tokens": (inst.get("train_grad_tokens", 0) + inst.get("train_nograd_tokens", 0))
                if inst
                else None,
                "train_grad_tokens": inst.get("train_grad_tokens"),
                "train_nograd_tokens": inst.get("train_nograd_tokens"),
                "response_length_mean": m.get("rollout/response_length_mean"),
                # samples with zero advantage get a forward but no backward (lichen/train/step_schedule.py)
                "skipped_frac": (m.get("train/skipped_samples") or 0) / max(len(inst.get("lengths") or []), 1),
                "skipped_samples": m.get("train/skipped_samples"),
            }
        )
    return steps


def trl_steps(child: dict) -> list[dict]:
    steps = []
    for s in child.get("steps", []):
        steps.append(
            {
                "step_time": s["step_time"],
                "generate_time": s["generate_time"],
                "train_time": s["train_time"],
                "engine_time": s["engine_time"],
                "reward_mean": s.get("reward_mean"),
                "lengths": s["lengths"],
                "engine_tokens": s["engine_tokens"],
                "train_tokens": s["train_grad_tokens"] + s["train_nograd_tokens"],
                "train_grad_tokens": s["train_grad_tokens"],
                "train_nograd_tokens": s["train_nograd_tokens"],
            }
        )
    return steps


def summarize_run(
    steps: list[dict], shape: dict, matmul_flops: float | None, peak_rss_kib: int | None, wall_s: float | None
) -> dict:
    """One run's numbers (see the module docstring for what is averaged and how)."""
    timed = _timed(steps)
    n = len(timed)
    out: dict = {"num_steps": len(steps), "num_timed_steps": n}
    if not n:
        return out
    step_sum = sum(s["step_time"] for s in timed)
    gen = [s["generate_time"] for s in timed]
    train = [s["train_time"] for s in timed]
    out["step_time_s"] = step_sum / n
    # A shared machine only ever adds time: the median and the fastest step are the noise-robust views.
    out["step_time_median_s"] = statistics.median(s["step_time"] for s in timed)
    out["step_time_min_s"] = min(s["step_time"] for s in timed)
    if all(g is not None for g in gen) and all(t is not None for t in train):
        out["generate_median_s"] = statistics.median(gen)
        out["train_median_s"] = statistics.median(train)
        out["generate_min_s"], out["train_min_s"] = min(gen), min(train)
    out["generate_s"] = _mean(gen)
    out["train_s"] = _mean(train)
    if out["generate_s"] is not None and out["train_s"] is not None:
        out["other_s"] = out["step_time_s"] - out["generate_s"] - out["train_s"]
    engine = [s["engine_time"] for s in timed]
    out["engine_s"] = _mean(engine) if all(e is not None for e in engine) else None
    have_lengths = all(s["lengths"] for s in timed)
    if have_lengths:
        resp = sum(r for s in timed for _, r in s["lengths"])
        useful = sum(useful_tokens(p, r) for s in timed for p, r in s["lengths"])
        flops = sum(batch_forward_flops(shape, s["lengths"]) for s in timed)
        out["response_tokens"] = resp / n
        out["engine_useful_positions"] = useful / n
        out["train_useful_positions"] = useful / n
        out["rollout_tokens_per_s"] = resp / step_sum
        if out["engine_s"]:
            out["engine_tokens_per_s"] = resp / (out["engine_s"] * n)
            out["engine_gflops"] = flops / (out["engine_s"] * n) / 1e9
        if out["train_s"]:
            # forward + backward = 3x the forward for trained samples; a skipped sample (zero advantage) only had
            # its forward, counted by its share of the step's samples
            train_flops = sum(
                batch_forward_flops(shape, s["lengths"]) * (3 - 2 * s.get("skipped_frac", 0.0)) for s in timed
            )
            out["trainer_gflops"] = train_flops / (out["train_s"] * n) / 1e9
            computed = computed_train_flops(shape, timed)
            if computed is not None:
                out["trainer_computed_gflops"] = computed / (out["train_s"] * n) / 1e9
        trained = [s.get("train_grad_tokens") for s in timed]
        if all(t for t in trained):
            out["train_useful_per_trained_position"] = useful / sum(trained)
        apply_peak(out, matmul_flops)
    if all(s["engine_tokens"] is not None for s in timed):
        out["engine_computed_positions"] = sum(s["engine_tokens"] for s in timed) / n
    if all(s["train_tokens"] is not None for s in timed):
        out["train_computed_positions"] = sum(s["train_tokens"] for s in timed) / n
    skipped = [s.get("skipped_samples") for s in timed]
    if all(x is not None for x in skipped):
        out["skipped_samples"] = sum(skipped) / n
    out["reward_mean"] = _mean(s["reward_mean"] for s in steps)
    out["reward_curve"] = [s["reward_mean"] for s in steps]
    out["step_times"] = [s["step_time"] for s in steps]
    if peak_rss_kib:
        out["peak_rss_mib"] = peak_rss_kib / 1024
    out["wall_s"] = wall_s
    return out


def computed_train_flops(shape: dict, steps: list[dict]) -> float | None:
    """The trainer's FLOPs over the positions it computed: per step, the useful forward FLOPs per useful position
    x (3 x trained positions + no-grad positions); None without the per-step counts."""
    total = 0.0
    for s in steps:
        grad, nograd = s.get("train_grad_tokens"), s.get("train_nograd_tokens")
        if grad is None or nograd is None or not s["lengths"]:
            return None
        per_position = batch_forward_flops(shape, s["lengths"]) / sum(useful_tokens(p, r) for p, r in s["lengths"])
        total += per_position * (3 * grad + nograd)
    return total


def apply_peak(summary: dict, matmul_flops: float | None) -> None:
    """Set the engine / trainer fractions of the matmul throughput `matmul_flops` (FLOP/s) in `summary`."""
    for key, frac in (
        ("engine_gflops", "engine_matmul_frac"),
        ("trainer_computed_gflops", "trainer_computed_matmul_frac"),
    ):
        if matmul_flops and summary.get(key) is not None:
            summary[frac] = summary[key] * 1e9 / matmul_flops


def medians(runs: list[dict]) -> dict:
    """Median over repeats of every numeric metric, plus min and max (the spread shows the machine's noise).

    Exception: the "fastest" metrics (keys ending in `_min_s`) take the minimum over repeats, i.e. the fastest
    step seen in any run -- the estimate least disturbed by other work on the machine.
    """
    out: dict = {}
    for key, *_ in METRICS:
        vals = [r[key] for r in runs if r.get(key) is not None]
        if vals:
            out[key] = min(vals) if key.endswith("_min_s") else statistics.median(vals)
            out[key + "_min"], out[key + "_max"] = min(vals), max(vals)
    curves = [r["reward_curve"] for r in runs if r.get("reward_curve")]
    if curves:
        width = max(len(c) for c in curves)
        out["reward_curve"] = [
            statistics.median([c[i] for c in curves if i < len(c) and c[i] is not None] or [float("nan")])
            for i in range(width)
        ]
    return out


def ratios(lichen: dict, trl: dict) -> dict:
    return {
        key: lichen[key] / trl[key]
        for key, *_ in METRICS
        if lichen.get(key) is not None and trl.get(key) not in (None, 0)
    }


def _fmt(fmt: str, value) -> str:
    return "-" if value is None else fmt.format(value)


# the rows printed for lichen's zero-advantage-skip variant (the rest repeat the equal-work table)
SKIP_VARIANT_KEYS = (
    "step_time_s",
    "step_time_median_s",
    "generate_s",
    "train_s",
    "train_median_s",
    "skipped_samples",
    "reward_mean",
    "peak_rss_mib",
)


def format_table(name: str, lichen: dict, trl: dict | None, ratio: dict, keys: tuple[str, ...] | None = None) -> str:
    head = f"{'metric (' + name + ', medians over repeats)':<46} {'lichen':>12} {'TRL':>12} {'lichen/TRL':>11}"
    lines = [head, "-" * len(head)]
    for key, label, unit, fmt in METRICS:
        if keys is not None and key not in keys:
            continue
        if lichen.get(key) is None and (not trl or trl.get(key) is None):
            continue
        lab = f"{label} [{unit}]" if unit else label
        lines.append(
            f"{lab:<46} {_fmt(fmt, lichen.get(key)):>12} "
            f"{_fmt(fmt, trl.get(key) if trl else None):>12} {_fmt('{:.3f}', ratio.get(key)):>11}"
        )
    return "\n".join(lines)


def format_limits(name: str, gen: dict, shape: dict) -> str:
    if not gen:
        return f"limits ({name}): not measured"
    mm = gen.get("matmul", {})
    peak = gen.get("peak_flops_per_s") or mm.get("best_flops_per_s")
    ends = [m.get("best_flops_per_s") for m in (mm, gen.get("matmul_end") or {}) if m.get("best_flops_per_s")]
    lines = [
        f"limits ({name}): fp32 matmul {mm.get('size')}^3 on {mm.get('threads')} threads, best of "
        f"{mm.get('repeats', '?')}: "
        + " / ".join(f"{x / 1e9:.1f}" for x in ends)
        + " GFLOP/s (before"
        + (" / after the runs)" if len(ends) > 1 else ")")
        + f"; peak used: {_fmt('{:.1f}', peak / 1e9 if peak else None)}"
    ]
    for key, label in (("hf", "HF model.generate"), ("lichen", "lichen Engine    ")):
        runs = gen.get(key) or []
        if not runs:
            continue
        tps = statistics.median(sum(r for _, r in x["lengths"]) / x["time"] for x in runs)
        gflops = statistics.median(batch_forward_flops(shape, x["lengths"]) / x["time"] / 1e9 for x in runs)
        comp = statistics.median(x["computed_tokens"] for x in runs)
        useful = statistics.median(sum(useful_tokens(p, r) for p, r in x["lengths"]) for x in runs)
        frac = f", {gflops * 1e9 / peak:.3f} of matmul" if peak else ""
        lines.append(
            f"  {label} on the step-1 batch (forced identical lengths): {tps:.1f} useful tok/s, {gflops:.2f} useful GFLOP/s{frac}; "
            f"positions computed/useful {comp:.0f}/{useful:.0f}"
        )
    hf, li = gen.get("hf_useful_tokens_per_s_median"), gen.get("lichen_useful_tokens_per_s_median")
    if hf and li:
        lines.append(f"  lichen Engine / HF generate useful tok/s: {li / hf:.2f}x")
    for err in gen.get("errors", []):
        lines.append(f"  error: {err}")
    return "\n".join(lines)
