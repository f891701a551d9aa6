"""What the benchmarks record about the machine and the code, the load check, and fresh run directories.

Load: a benchmark's timings are only as good as the cores it gets. The 1-minute load average is read before and
after each benchmark; when it exceeds the cores the benchmark itself uses (torch threads x concurrent runs), other
work competed for them and the report says so loudly instead of letting the ratios pass as clean.

Run directories: `lichen train` appends to an existing metrics.jsonl, so a reused output directory would report a
previous run's steps as this run's. Every invocation therefore writes its runs under a new `runs-NNN` directory
of the work directory (checkpoints and prompt files, which are deterministic, stay shared).
"""

from __future__ import annotations

import os
import platform
import subprocess

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def code_version() -> dict:
    """The lichen commit measured and how many files differ from it (read-only git queries; None outside git)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        status = subprocess.run(
            ["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "changed_files": None}
    if commit.returncode != 0:
        return {"commit": None, "changed_files": None}
    return {"commit": commit.stdout.strip(), "changed_files": len(status.stdout.splitlines())}


def usable_cpus() -> int | None:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def machine_info() -> dict:
    cpu = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        pass
    import torch

    return {
        "code": code_version(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable_cpus(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "loadavg_start": load_average(),
    }


def load_average() -> tuple[float, float, float] | None:
    return os.getloadavg() if hasattr(os, "getloadavg") else None


def load_check(tag: str, when: str, cores_used: int, load: tuple[float, float, float] | None = None) -> dict:
    """Read (or take) the load average, print it, and warn loudly when its 1-minute value exceeds `cores_used`.

    Returns {"when", "loadavg", "cores_used", "overloaded"} for the JSON report."""
    load = load if load is not None else load_average()
    over = load is not None and load[0] > cores_used
    text = "unknown" if load is None else " ".join(f"{x:.2f}" for x in load)
    print(
        f"[{tag}] load average {when}: {text} (1/5/15 min); this benchmark uses {cores_used} core(s) of "
        f"{usable_cpus()}",
        flush=True,
    )
    if over:
        print(
            warning_banner(
                f"{tag}: load average {load[0]:.2f} {when} exceeds the {cores_used} core(s) this "
                f"benchmark uses: other work competed for the CPUs, so its times and ratios are not "
                f"clean measurements"
            ),
            flush=True,
        )
    return {"when": when, "loadavg": load, "cores_used": cores_used, "overloaded": over}


def warning_banner(text: str) -> str:
    bar = "!" * 100
    return f"{bar}\n!! WARNING: {text}\n{bar}"


def overloaded_summary(checks: list[dict]) -> str | None:
    """One line naming every load check that exceeded its cores, or None when none did."""
    bad = [f"{c['when']} ({c['loadavg'][0]:.2f} > {c['cores_used']})" for c in checks if c.get("overloaded")]
    return ("load average exceeded the cores used: " + ", ".join(bad)) if bad else None


def fresh_run_dir(parent: str) -> str:
    """Create and return `parent/runs-NNN`, the first number not taken (see the module docstring)."""
    os.makedirs(parent, exist_ok=True)
    n = 1
    while True:
        path = os.path.join(parent, f"runs-{n:03d}")
        try:
            os.mkdir(path)  # atomic: two invocations sharing a work dir never get the same directory
            return path
        except FileExistsError:
            n += 1
