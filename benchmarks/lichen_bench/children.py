"""Child processes of the benchmarks: environment, launch with a timeout, own peak RSS and CPU time, log tail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from lichen_bench.machine import REPO_ROOT


def child_env(threads: int, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update(extra or {})
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_NO_ADVISORY_WARNINGS="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def run_child(cmd: list[str], log_path: str, *, timeout: float, threads: int, extra_env: dict | None = None) -> dict:
    """Run `cmd`, logging to `log_path`; returns rc, wall seconds and this child's own peak RSS (KiB)."""
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(threads, extra_env))
        killed = False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if not killed and time.perf_counter() - t0 > timeout:
                proc.kill()
                killed = True
            time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {
        "rc": proc.returncode,
        "timed_out": killed,
        "wall_s": time.perf_counter() - t0,
        "maxrss_kib": usage.ru_maxrss,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "log": log_path,
    }


def tail(path: str, n: int = 15) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def load_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def split_passthrough(argv: list[str] | None) -> tuple[list[str], list[str]]:
    """(own arguments, arguments after `--` for the child script); argv None: the command line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]
