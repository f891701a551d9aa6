"""`--trace`: the run's phases as a Chrome trace (JSON Object Format), which ui.perfetto.dev and chrome://tracing
open.

The file `<output_dir>/trace.json` is rewritten whole after every step, so it is valid JSON at any time and can
be opened while the run goes on. Each finished phase of lichen.observe.phases is one complete event
(`"ph": "X"`, `ts`/`dur` in microseconds since the run started) on its process (`pid`) and thread (`tid`), with
the step and the phase's arguments in `args`; metadata events (`"ph": "M"`) name the processes and threads.
"""

from __future__ import annotations

import json
import os
import time
from typing import Iterable

from lichen.observe.phases import PhaseRecord, tracker

TRACE_FILE = "trace.json"


def trace_events(records: Iterable[PhaseRecord], *, t0: float, pid: int, process_name: str) -> list[dict]:
    """Chrome trace events of `records` (finished phases of process `pid`), timestamps relative to `t0`."""
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": process_name}}]
    threads: dict[int, str] = {}
    for r in sorted(records, key=lambda r: r.start):
        if r.end is None:
            continue
        threads.setdefault(r.thread_id, r.thread_name)
        args = {"rollout_id": r.step, **r.args} if r.step is not None else dict(r.args)
        events.append({"name": r.name, "cat": "phase", "ph": "X", "pid": pid, "tid": r.thread_id,
                       "ts": round((r.start - t0) * 1e6, 3), "dur": round((r.end - r.start) * 1e6, 3),
                       "args": args})
    events += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
               for tid, name in threads.items()]
    return events


def trace_payload(since: float) -> dict:
    """This process' finished phases that ended after `since`, as plain data (lichen serve's GET /debug/trace):
    {"pid", "now", "records": [{name, step, start, end, thread_id, thread_name, args}]}."""
    records = [{"name": r.name, "step": r.step, "start": r.start, "end": r.end, "thread_id": r.thread_id,
                "thread_name": r.thread_name, "args": r.args} for r in tracker().finished(since)]
    return {"pid": os.getpid(), "now": time.time(), "records": records}


def records_from_payload(payload: dict) -> list[PhaseRecord]:
    return [PhaseRecord(r["name"], r.get("step"), float(r["start"]), int(r["thread_id"]), str(r["thread_name"]),
                        dict(r.get("args") or {}), float(r["end"])) for r in payload.get("records", [])]


def write_trace(path: str, events: list[dict]) -> None:
    """Write atomically (temp file + rename), so a reader never sees half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    os.replace(tmp, path)
