"""`--trace`: the run's phases as a Chrome trace (JSON Object Format), which ui.perfetto.dev and chrome://tracing
open.

The file `<output_dir>/trace.json` is rewritten whole after every step, so it is valid JSON at any time and can
be opened while the run goes on. Each finished phase of lichen.observe.phases is one complete event
(`"ph": "X"`, `ts`/`dur` in microseconds since the run started) on its process (`pid`) and thread (`tid`), with
the step and the phase's arguments in `args`; metadata events (`"ph": "M"`) name the processes and threads.

Processes: the driver; each `lichen serve` engine server and each Ray trainer rank, which record their own phases
and hand them over (`trace_payload`); and services the driver calls but cannot look into (a remote reward model),
whose lane holds the requests as the driver timed them (`remote_lanes`).
"""

from __future__ import annotations

import json
import os
import time
from typing import Iterable

from lichen.observe.phases import PhaseRecord, tracker

TRACE_FILE = "trace.json"
# A phase argument naming another process the phase is a request to (a remote reward model): the driver cannot
# trace inside it, so its requests, timed by the driver, make that process' lane (see `remote_lanes`).
REMOTE_ARG = "remote_process"
# pids of those lanes: above Linux's largest pid (2**22), so they never collide with a real process'
REMOTE_PID_BASE = 10_000_000


def trace_events(records: Iterable[PhaseRecord], *, t0: float, pid: int, process_name: str) -> list[dict]:
    """Chrome trace events of `records` (finished phases of process `pid`), timestamps relative to `t0`."""
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": process_name}}]
    threads: dict[int, str] = {}
    for r in sorted(records, key=lambda r: r.start):
        if r.end is None:
            continue
        threads.setdefault(r.thread_id, r.thread_name)
        args = {"rollout_id": r.step, **r.args} if r.step is not None else dict(r.args)
        events.append(
            {
                "name": r.name,
                "cat": "phase",
                "ph": "X",
                "pid": pid,
                "tid": r.thread_id,
                "ts": round((r.start - t0) * 1e6, 3),
                "dur": round((r.end - r.start) * 1e6, 3),
                "args": args,
            }
        )
    events += [
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
        for tid, name in threads.items()
    ]
    return events


def trace_payload(since: float, process_name: str | None = None) -> dict:
    """This process' finished phases that ended after `since`, as plain data (lichen serve's GET /debug/trace, a
    Ray trainer rank's `trace` call): {"pid", "now", "records": [{name, step, start, end, thread_id, thread_name,
    args}]}, and "process_name" when given (the lane's name in the driver's trace)."""
    records = [
        {
            "name": r.name,
            "step": r.step,
            "start": r.start,
            "end": r.end,
            "thread_id": r.thread_id,
            "thread_name": r.thread_name,
            "args": r.args,
        }
        for r in tracker().finished(since)
    ]
    out = {"pid": os.getpid(), "now": time.time(), "records": records}
    if process_name:
        out["process_name"] = process_name
    return out


def remote_lanes(records: Iterable[PhaseRecord]) -> tuple[list[PhaseRecord], dict[str, list[PhaseRecord]]]:
    """Split this process' records into its own and those of services it called (a phase with the argument
    REMOTE_ARG names the service, e.g. a remote reward model's URL): {service: its requests}, each request on the
    first lane ("request slot") free at its start, since requests overlap and slices on one thread must nest."""
    own: list[PhaseRecord] = []
    remote: dict[str, list[PhaseRecord]] = {}
    for r in records:
        (remote.setdefault(str(r.args[REMOTE_ARG]), []) if REMOTE_ARG in r.args else own).append(r)
    for name, recs in remote.items():
        free_at: list[float] = []  # per slot, when its last request ended
        placed = []
        for r in sorted(recs, key=lambda r: r.start):
            slot = next((k for k, t in enumerate(free_at) if t <= r.start), len(free_at))
            free_at[slot : slot + 1] = [r.end or r.start]
            args = {k: v for k, v in r.args.items() if k != REMOTE_ARG}
            placed.append(PhaseRecord(r.name, r.step, r.start, slot + 1, f"request slot {slot + 1}", args, r.end))
        remote[name] = placed
    return own, remote


def records_from_payload(payload: dict) -> list[PhaseRecord]:
    return [
        PhaseRecord(
            r["name"],
            r.get("step"),
            float(r["start"]),
            int(r["thread_id"]),
            str(r["thread_name"]),
            dict(r.get("args") or {}),
            float(r["end"]),
        )
        for r in payload.get("records", [])
    ]


def write_trace(path: str, events: list[dict]) -> None:
    """Write atomically (temp file + rename), so a reader never sees half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    os.replace(tmp, path)
