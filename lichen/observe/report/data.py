"""What `lichen report` reads from a run directory, as one JSON-ready dict for the page."""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

from lichen.errors import ConfigError
from lichen.observe.metrics import METRICS_FILE, read_metrics
from lichen.observe.sample_log import read_samples
from lichen.observe.trace import TRACE_FILE
from lichen.observe.watchdog import WATCHDOG_DIR
from lichen.safe_files import UnsafeFile, read_inside

_ITER = re.compile(r"^iter_(\d+)$")
_LATEST = "latest_checkpointed_iteration.txt"  # lichen.train.checkpoint.LATEST (observe does not import train)
TIMELINE_STEPS = 20  # the timeline shows the trace's last rollouts, so the page stays small for long runs


def _checkpoints(save_dir: str | None) -> list[dict]:
    """The iter_* directories under --save: rollout id, weight version, size, time, whether marked complete."""
    if not save_dir or not os.path.isdir(save_dir):
        return []
    latest = None
    try:  # read as a checkpoint load reads it: a regular file inside save_dir, a few bytes (never a FIFO)
        latest = int(read_inside(save_dir, _LATEST, 64).decode("utf-8").strip())
    except (OSError, ValueError, UnsafeFile):
        pass
    out = []
    for name in sorted(os.listdir(save_dir)):
        m = _ITER.match(name)
        path = os.path.join(save_dir, name)
        if not m or not os.path.isdir(path):
            continue
        meta: dict = {}
        try:
            meta = json.loads(read_inside(path, "meta.json", 1 << 20))
        except (OSError, ValueError, RecursionError, UnsafeFile):
            pass
        if not isinstance(meta, dict):
            meta = {}
        # lstat: a planted link counts as itself, so the page never shows the size of a file outside the run
        size = sum(os.lstat(os.path.join(root, f)).st_size for root, _, files in os.walk(path) for f in files)
        out.append(
            {
                "name": name,
                "path": path,
                "rollout_id": int(m.group(1)),
                "weight_version": meta.get("weight_version"),
                "bytes": size,
                "time": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(os.path.getmtime(path))),
                "latest": latest == int(m.group(1)),
            }
        )
    return out


def _hangs(run_dir: str) -> list[dict]:
    folder = os.path.join(run_dir, WATCHDOG_DIR)
    if not os.path.isdir(folder):
        return []
    out = []
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
            out.append({"name": name, "text": f.read(20000)})
    return out


def _timeline(run_dir: str, last_steps: int = TIMELINE_STEPS) -> dict | None:
    """The trace's slices of the last `last_steps` rollouts (and their threads' names), for the timeline chart."""
    try:
        with open(os.path.join(run_dir, TRACE_FILE), encoding="utf-8") as f:
            events = json.load(f)["traceEvents"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None
    slices = [e for e in events if e.get("ph") == "X"]
    steps = sorted({e.get("args", {}).get("rollout_id") for e in slices} - {None})
    keep = set(steps[-last_steps:])
    kept = [e for e in slices if e.get("args", {}).get("rollout_id") in keep]
    if not kept:
        return None
    # slices of no known rollout (an engine busy while the driver trains, with --async) within the same window
    lo, hi = min(e["ts"] for e in kept), max(e["ts"] + e["dur"] for e in kept)
    slices = kept + [e for e in slices if e.get("args", {}).get("rollout_id") is None and lo <= e["ts"] <= hi]
    names = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    lanes = sorted({(e["pid"], e["tid"]) for e in slices})
    return {
        "lanes": [names.get(lane, f"thread {lane[1]}") for lane in lanes],
        "slices": [
            {
                "lane": lanes.index((e["pid"], e["tid"])),
                "name": e["name"],
                "ts": e["ts"],
                "dur": e["dur"],
                "rollout_id": e["args"].get("rollout_id"),
            }
            for e in slices
        ],
    }


def collect(run_dir: str) -> dict[str, Any]:
    """Everything the page shows. A run directory needs metrics.jsonl; the rest is shown when present."""
    if not os.path.isdir(run_dir):
        raise ConfigError(f"lichen report: RUN_DIR {run_dir!r} is not a directory; give the --output-dir of a run")
    if not os.path.isfile(os.path.join(run_dir, METRICS_FILE)):
        raise ConfigError(f"lichen report: {run_dir!r} holds no {METRICS_FILE}; give the --output-dir of a run")
    config: dict = {}
    try:
        with open(os.path.join(run_dir, "config.json"), encoding="utf-8", errors="replace") as f:
            config = json.load(f)  # written with its secrets redacted (lichen.loop.prepare_output_dir)
    except (OSError, ValueError, RecursionError):
        pass
    if not isinstance(config, dict):
        config = {}
    return {
        "run_dir": os.path.abspath(run_dir),
        "generated": time.strftime("%Y-%m-%d %H:%M:%S"),
        "metrics": read_metrics(run_dir),
        "samples": read_samples(run_dir),
        "config": config,
        "checkpoints": _checkpoints(config.get("save")),
        "hangs": _hangs(run_dir),
        "has_trace": os.path.isfile(os.path.join(run_dir, TRACE_FILE)),
        "timeline": _timeline(run_dir),
    }
