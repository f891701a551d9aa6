"""Child process of `lichen bench rl`: runs `lichen train` with light instrumentation and writes what it saw.

    python -m lichen_bench.run_lichen RESULT.json -- <lichen train flags>

Instrumentation only observes (it changes no computation): it wraps
  - `CausalLM.forward` to count the token positions each forward runs (rows x sequence length, so padding and
    finished rows still in the batch count), split into engine / trainer-with-grad / trainer-no-grad;
  - `Engine.generate` to time the engine alone (time/generate also includes reward scoring);
  - `RolloutManager.generate` to record each step's (prompt length, response length) pairs and mark step
    boundaries.
A wrap whose target is missing (the code changed) is skipped and named in `instrumentation_missing`.
With LICHEN_BENCH_PROFILE=PATH in the environment the run is profiled with cProfile and the top functions
(by own time, then cumulative) are written to PATH.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

from lichen_bench.counting import positions, record_forward

STATE: dict = {"steps": [], "phase": "train", "missing": []}


def _current() -> dict:
    if not STATE["steps"]:
        STATE["steps"].append(_new_step())
    return STATE["steps"][-1]


def _new_step() -> dict:
    return {
        "engine_tokens": 0,
        "train_grad_tokens": 0,
        "train_nograd_tokens": 0,
        "engine_time": 0.0,
        "engine_forwards": 0,
        "lengths": [],
    }


def _wrap(module_name: str, class_name: str, attr: str, make_wrapper) -> None:
    import importlib

    try:
        cls = getattr(importlib.import_module(module_name), class_name)
        original = getattr(cls, attr)
    except (ImportError, AttributeError):
        STATE["missing"].append(f"{module_name}.{class_name}.{attr}")
        return
    setattr(cls, attr, functools.wraps(original)(make_wrapper(original)))


def _forward_wrapper(original):
    def forward(self, input_ids, *args, **kwargs):
        record_forward(_current(), STATE["phase"], positions(input_ids))
        return original(self, input_ids, *args, **kwargs)

    return forward


def _engine_wrapper(original):
    def generate(self, *args, **kwargs):
        prev, STATE["phase"] = STATE["phase"], "engine"
        t0 = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            _current()["engine_time"] += time.perf_counter() - t0
            STATE["phase"] = prev

    return generate


def _rollout_wrapper(original):
    def generate(self, rollout_id, *args, **kwargs):
        STATE["steps"].append(_new_step())
        groups, metrics = original(self, rollout_id, *args, **kwargs)
        STATE["steps"][-1]["lengths"] = [[int(s.prompt_length), int(s.response_length)] for g in groups for s in g]
        return groups, metrics

    return generate


def install() -> None:
    torch_profile = os.environ.get("LICHEN_BENCH_TORCH_PROFILE")  # PREFIX:STEP:ROWS, see lichen_bench.torch_profile
    if torch_profile:  # innermost, so the timing wraps below stay outside the profiler
        from lichen_bench.torch_profile import install as install_profiler

        prefix, step, rows = torch_profile.rsplit(":", 2)
        install_profiler(prefix, int(step), int(rows))
    _wrap("lichen.models.transformer", "CausalLM", "forward", _forward_wrapper)
    _wrap("lichen.engines.core.engine", "Engine", "generate", _engine_wrapper)
    _wrap("lichen.rollout.manager", "RolloutManager", "generate", _rollout_wrapper)


def _torch_threads() -> int | None:
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] != "--":
        print("usage: python -m lichen_bench.run_lichen RESULT.json -- <lichen train flags>", file=sys.stderr)
        return 2
    result_path, train_args = argv[0], argv[2:]
    t0 = time.perf_counter()
    install()
    from lichen.cli import main as cli_main
    from lichen.observe.phases import lifetime_peak_rss_bytes

    profile_path = os.environ.get("LICHEN_BENCH_PROFILE")
    if profile_path:  # an untimed extra run: cProfile of the whole process, top functions by own time
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        rc = prof.runcall(cli_main, ["train", *train_args])
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats(40)
        with open(profile_path, "w", encoding="utf-8") as f:
            f.write(text.getvalue())
    else:
        rc = cli_main(["train", *train_args])
    have_steps = "lichen.rollout.manager.RolloutManager.generate" not in STATE["missing"]
    steps = [s for s in STATE["steps"] if s["lengths"]] if have_steps else STATE["steps"]
    with open(result_path, "w", encoding="utf-8") as f:
        json.dump(
            {
                "rc": rc,
                "wall_s": time.perf_counter() - t0,
                "steps": steps,
                "instrumentation_missing": STATE["missing"],
                # not ru_maxrss: lichen resets VmHWM per phase, which lowers ru_maxrss (and the parent's wait4) to
                # the last phase's peak
                "lifetime_peak_rss_kib": lifetime_peak_rss_bytes() // 1024,
                "torch_threads": _torch_threads(),
            },
            f,
        )
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
