"""The chaos run (docs/fault-tolerance.md#chaos-run): the same seeded `lichen train` twice, fault-free and under a
seeded schedule of faults, and what the faults cost.

    .venv/bin/python scripts/chaos_run.py --runtime local --seed 1 --steps 4
    .venv/bin/python scripts/chaos_run.py --runtime ray --seed 1 --steps 4

Both runs train a tiny model (made here) on the same prompts with seeded sampling, a fixed batch schedule and a
checkpoint after every step. The faults (tests/chaos_plugins.py; each fires at a point of the run, never at a
time):

- local (two launched `lichen serve` engines, --use-fault-tolerance, delta disk sync): engine SIGKILL
  mid-rollout, an engine hung (SIGSTOP) past its health-check timeout, a corrupt delta file, the run's process
  SIGKILLed in the middle of a checkpoint save (its files written, not its manifest nor `latest`);
- ray (two trainer ranks, two `lichen serve` engine actors, --max-trainer-restarts, --use-fault-tolerance): a rank
  SIGKILLed mid-train, a rank SIGKILLed mid-sync (inside a weight broadcast bucket), an engine actor's server
  SIGKILLed mid-rollout.

A fault that ends the run (a corrupt delta stops it, by design; a killed process) is recovered as a scheduler would: the same
command again with `--load` of its --save directory. The report: the faults injected, the steps replayed (work
lost), the samples trained per step against the fault-free run (none twice, none lost), the max weight difference.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, "tests")
sys.path[:0] = [p for p in (REPO, TESTS) if p not in sys.path]

from chaos_plugins import LOG, TRIGGERS_ENV  # noqa: E402
from conftest import write_addition  # noqa: E402
from helpers.runs import base_args, final_weights, read_dump  # noqa: E402

from lichen.observe.metrics import read_metrics  # noqa: E402
from lichen.weights.rank_send import KILL_IN_BUCKET_ENV  # noqa: E402

# kind -> (runtime, first step it may hit, how far from the last step, what it is)
FAULTS = {
    "engine_kill": ("local", 1, 0, "engine SIGKILL mid-rollout"),
    "slow_engine": ("local", 1, 0, "engine hung past its health-check timeout"),
    "corrupt_delta": (
        "local",
        2,
        1,
        "corrupt delta file (version 1 is the chain's full version; the last is not synced)",
    ),
    "ckpt_kill": ("local", 1, 0, "the process killed mid-save (checkpoint files written, no manifest or latest)"),
    "rank_kill_train": ("ray", 1, 0, "trainer rank SIGKILL mid-train"),
    "ray_engine_kill": ("ray", 1, 0, "engine SIGKILL mid-rollout (the server of a Ray engine actor)"),
    "rank_kill_sync": ("ray", 1, 1, "trainer rank SIGKILL mid-sync (weight version k's broadcast)"),
}
BUFFER = 64 * 1024  # broadcast bucket size: several buckets per sync, so the kill is mid-sync
HEALTH_FLAGS = [  # engines watched, restarted and re-joined; a hung one is found within 5 s
    "--use-fault-tolerance",
    "--rollout-health-check-interval",
    "0.5",
    "--rollout-health-check-timeout",
    "5",
    "--rollout-health-check-first-wait",
    "0",
]
Runner = Callable[[list[str], dict[str, str]], int]


def schedule(runtime: str, seed: int, steps: int, kinds: list[str] | None = None) -> list[tuple[str, int]]:
    """(kind, step) for each fault kind of `runtime` (or `kinds`), on distinct steps drawn with `seed`."""
    kinds = kinds if kinds is not None else [k for k, v in FAULTS.items() if v[0] == runtime]
    rng = random.Random(seed)
    for _ in range(1000):
        steps_of = {k: rng.randint(FAULTS[k][1], steps - FAULTS[k][2]) for k in kinds}
        if len(set(steps_of.values())) == len(kinds):
            return sorted(steps_of.items(), key=lambda kv: kv[1])
    raise SystemExit(f"chaos_run: {len(kinds)} faults do not fit on distinct steps of {steps}; raise --steps")


def buckets_per_sync(model_dir: str) -> int:
    """How many broadcast buckets one sync of `model_dir` takes (float32, lichen serve's dtype; BUFFER)."""
    import torch

    from lichen.models import load_model
    from lichen.weights.rank_send import plan_meta_buckets, tensor_meta

    model = load_model(model_dir, dtype=torch.float32)
    return len(plan_meta_buckets([tensor_meta(n, p) for n, p in model.named_parameters()], torch.float32, BUFFER))


def run_argv(runtime: str, model: str, data: str, out: str, save: str, steps: int, seed: int, env: dict) -> list:
    """The `lichen train` command line of one attempt (the fault-free run's too: the plug-ins do nothing there)."""
    common = [
        "--seed",
        str(seed),
        "--num-rollout",
        str(steps),
        "--device",
        "cpu",
        "--num-threads",
        "1",
        "--save",
        save,
        "--save-interval",
        "1",
        "--no-async-save",  # a checkpoint is complete before the step goes on: what a fault loses never varies
        "--save-debug-rollout-data",
        os.path.join(out, "r_{rollout_id}.pt"),
        "--custom-advantage-function-path",
        "chaos_plugins.advantage",
    ]
    if runtime == "ray":
        extra = [
            "--runtime",
            "ray",
            "--actor-num-gpus-per-node",
            "2",
            "--rollout-num-gpus",
            "2",  # two engines: a killed one re-joins at the next broadcast while the other serves
            "--update-weight-transport",
            "nccl",
            "--update-weight-buffer-size",
            str(BUFFER),
            "--max-trainer-restarts",
            "4",
            *HEALTH_FLAGS,
            "--rollout-function-path",
            "chaos_plugins.rollout",
            "--train-env-vars",
            json.dumps(env),
        ]
    else:
        extra = [
            "--rollout-num-engines",
            "2",
            "--sglang-server-concurrency",
            "1",
            "--update-weight-transport",
            "disk",
            "--update-weight-mode",
            "delta",
            "--update-weight-disk-dir",
            os.path.join(os.path.dirname(save), "weights"),
            "--update-weight-local-checkpoint-dir",
            os.path.join(os.path.dirname(save), "local_weights"),
            *HEALTH_FLAGS,
            "--rollout-function-path",
            "chaos_plugins.rollout",
            "--custom-update-weight-post-write-path",
            "chaos_plugins.corrupt_delta",
        ]
    return base_args(model, data, out, *common, *extra)


def subprocess_runner(argv: list[str], env: dict[str, str]) -> int:
    """`lichen train` as its own process (the script's way; the test runs it in process)."""
    path = os.pathsep.join([TESTS, REPO, os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "lichen.cli", *argv], env={**os.environ, **env, "PYTHONPATH": path}
    ).returncode


@dataclass
class Result:
    """One run (its attempts): where it saved, each attempt's output directory and exit code."""

    save: str
    attempts: list[tuple[str, int]] = field(default_factory=list)
    injected: list[str] = field(default_factory=list)
    armed_left: list[str] = field(default_factory=list)
    engine_restarts: int = 0  # engines restarted by --use-fault-tolerance (as the steps' metrics saw them)


def train(
    runtime: str,
    root: str,
    model: str,
    data: str,
    steps: int,
    seed: int,
    faults: list[tuple[str, int]],
    runner: Runner,
    max_attempts: int = 4,
) -> Result:
    """One run under `faults` (none: the fault-free run) in `root`, rerun with --load after a failed attempt."""
    triggers = os.path.join(root, "triggers")
    os.makedirs(triggers)
    env = {TRIGGERS_ENV: triggers, "PYTHONPATH": os.pathsep.join([TESTS, REPO])}
    for kind, step in faults:
        open(os.path.join(triggers, f"{kind}.{step}"), "w").close()
        if kind == "rank_kill_sync":  # rank 1 gathers version `step`'s 2nd bucket (v0 is the first) as the 1st is sent
            env[KILL_IN_BUCKET_ENV] = (
                f"1:{step * buckets_per_sync(model) + 2}:{os.path.join(triggers, f'{kind}.{step}')}"
            )
    res = Result(save=os.path.join(root, "ckpt"))
    load: list[str] = []
    for attempt in range(max_attempts):
        out = os.path.join(root, f"attempt{attempt}")
        rc = runner(run_argv(runtime, model, data, out, res.save, steps, seed, env) + load, env)
        res.attempts.append((out, rc))
        if rc == 0:
            break
        load = ["--load", res.save]  # what a scheduler does with a run that stopped: the same command, resumed
    else:
        raise SystemExit(f"chaos_run: {root}: the run failed {max_attempts} times; see its logs")
    log = os.path.join(triggers, LOG)
    res.injected = open(log).read().splitlines() if os.path.exists(log) else []
    res.armed_left = sorted(f for f in os.listdir(triggers) if f != LOG)
    for kind, step in faults:  # the sync kill is lichen's own hook: it only removes its trigger
        if kind == "rank_kill_sync" and f"{kind}.{step}" not in res.armed_left:
            res.injected.append(f"rank_kill_sync version {step}: trainer rank 1 SIGKILLed in a broadcast bucket")
    return res


def trained_steps(res: Result) -> tuple[dict[int, list], int, int, int, int]:
    """({step: (sample index, tokens) of the rollout it finally trained on, sorted}, completed steps trained
    again, trainer restarts, reruns with --load, rollouts generated again by a rerun). The rollout dumps (--save-debug-rollout-data, written before the
    step trains; a replay writes its own) say what each step trained on: a step's metrics row and sample log
    follow its sync, so a step whose sync failed has neither. A later attempt's dump of a step is the one the final
    weights hold. Completed steps (a metrics row) lost by a recovery: those a trainer restart replayed
    (`fault/steps_replayed`) and those of a failed attempt after the checkpoint the next attempt resumed from."""
    final: dict[int, list] = {}
    replayed = restarts = regenerated = 0
    res.engine_restarts = 0
    dumps = [_dumps(out) for out, _rc in res.attempts]
    for i, (out, _rc) in enumerate(res.attempts):
        rows = [m for m in read_metrics(out) if "train/loss" in m]
        restarts = max([restarts, *(int(m.get("fault/trainer_restarts", 0)) for m in rows)])
        res.engine_restarts += max([0, *(int(m.get("engines/restarts", 0)) for m in rows)])  # counted per attempt
        replayed += sum(int(m.get("fault/steps_replayed", 0)) for m in rows)
        if i + 1 < len(dumps):
            resumed_at = min(dumps[i + 1], default=1)
            replayed += len({m["step"] for m in rows if m["step"] >= resumed_at})
            # a step whose checkpoint never finished has no metrics row, but its rollout (and training) was done
            regenerated += len([step for step in dumps[i] if step >= resumed_at])
        final.update(dumps[i])
    return final, replayed, restarts, len(res.attempts) - 1, regenerated


def _dumps(out: str) -> dict[int, list]:
    """{step: sorted (sample index, tokens)} of the rollout dumps of one attempt's output directory."""
    found = {}
    for name in os.listdir(out) if os.path.isdir(out) else []:
        if name.startswith("r_") and name.endswith(".pt"):
            groups = read_dump(os.path.join(out, name))["samples"]
            found[int(name[2:-3]) + 1] = sorted((s["index"], s["tokens"]) for g in groups for s in g)
    return found


def compare(straight: Result, chaos: Result, steps: int) -> dict:
    """What the report prints: accounting and the max weight difference of the chaos run against the fault-free."""
    base, _, _, _, _ = trained_steps(straight)
    got, replayed, trainer_restarts, run_restarts, regenerated = trained_steps(chaos)
    per_step = {}
    for step in range(1, steps + 1):
        mine = got.get(step, [])
        indices = [i for i, _ in mine]
        per_step[step] = {
            "samples": len(mine),
            "twice": len(indices) - len(set(indices)),
            "lost": len(set(i for i, _ in base.get(step, [])) - set(indices)),
            "same_as_fault_free": mine == base.get(step),
        }
    wa, wb = final_weights(straight.save), final_weights(chaos.save)
    diff = (
        max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa) if wa.keys() == wb.keys() else float("inf")
    )
    return {
        "faults_injected": chaos.injected,
        "armed_not_fired": chaos.armed_left,
        "trainer_restarts": trainer_restarts,
        "engine_restarts": chaos.engine_restarts,
        "run_restarts_with_load": run_restarts,
        "steps_replayed": replayed,
        "rollouts_regenerated": regenerated,
        "per_step": per_step,
        "max_weight_diff": diff,
    }


def report(runtime: str, seed: int, steps: int, summary: dict) -> str:
    lines = [f"chaos run: --runtime {runtime} --seed {seed} --steps {steps}"]
    lines.append(f"faults injected: {len(summary['faults_injected'])}")
    lines += [f"  {line}" for line in summary["faults_injected"]]
    if summary["armed_not_fired"]:
        lines.append(f"  armed but never fired: {', '.join(summary['armed_not_fired'])}")
    lines.append(
        f"recoveries: {summary['trainer_restarts']} trainer restart(s), {summary['engine_restarts']} engine "
        f"restart(s) seen by a later step, {summary['run_restarts_with_load']} rerun(s) with --load"
    )
    lines.append(f"steps lost and replayed (completed steps trained again): {summary['steps_replayed']}")
    lines.append(f"rollouts generated again by a rerun with --load: {summary['rollouts_regenerated']}")
    for step, s in summary["per_step"].items():
        lines.append(
            f"  step {step}: {s['samples']} samples trained, {s['twice']} twice, {s['lost']} lost, "
            f"same samples as the fault-free run: {'yes' if s['same_as_fault_free'] else 'NO'}"
        )
    lines.append(f"max weight difference against the fault-free run: {summary['max_weight_diff']:.3g}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runtime", choices=["local", "ray"], default="local")
    p.add_argument("--seed", type=int, default=1, help="seeds the fault schedule and the runs (default: 1)")
    p.add_argument("--steps", type=int, default=4, help="training steps of each run (default: 4)")
    p.add_argument("--faults", help="comma-separated fault kinds (default: every kind of the runtime)")
    p.add_argument("--workdir", help="keep the runs here (default: a temporary directory, removed)")
    a = p.parse_args(argv)
    kinds = a.faults.split(",") if a.faults else None
    for k in kinds or []:
        if k not in FAULTS or FAULTS[k][0] != a.runtime:
            p.error(
                f"--faults: {k!r} is not a fault of --runtime {a.runtime}; choose from "
                f"{', '.join(k2 for k2, v in FAULTS.items() if v[0] == a.runtime)}"
            )
    faults = schedule(a.runtime, a.seed, a.steps, kinds)
    if a.workdir:
        os.makedirs(a.workdir, exist_ok=True)  # the runs go in a fresh directory inside it
    with tempfile.TemporaryDirectory(prefix="lichen-chaos-", dir=a.workdir) as root:
        from lichen.models.tiny import make_tiny_model

        model = os.path.join(root, "model")
        make_tiny_model(
            model, arch="llama", hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, seed=0, init_std=0.1
        )
        data = write_addition(os.path.join(root, "add.jsonl"), 64)
        print(f"chaos_run: schedule {faults}", flush=True)
        straight = train(
            a.runtime, os.path.join(root, "fault_free"), model, data, a.steps, a.seed, [], subprocess_runner
        )
        chaos = train(a.runtime, os.path.join(root, "chaos"), model, data, a.steps, a.seed, faults, subprocess_runner)
        summary = compare(straight, chaos, a.steps)
    print(report(a.runtime, a.seed, a.steps, summary))
    ok = summary["max_weight_diff"] <= 1e-6 and all(
        s["same_as_fault_free"] and not s["twice"] and not s["lost"] for s in summary["per_step"].values()
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
