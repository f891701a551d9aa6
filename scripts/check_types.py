#!/usr/bin/env python3
"""Type check `lichen/` with mypy against a baseline that may only shrink.

mypy's configuration is in pyproject.toml ([tool.mypy]). The baseline (scripts/mypy_baseline.txt) counts today's
errors per (file, error code); line numbers are left out so that unrelated edits do not churn it. The check fails
when any file has more errors of a code than the baseline allows, printing those errors. When errors were fixed it
says so: `scripts/check_types.py --update` then lowers the baseline, and refuses to raise any count.

Usage: scripts/check_types.py [--update]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / "scripts" / "mypy_baseline.txt"
# "lichen/x.py:12: error: message  [code]" (mypy's default output with show_error_codes)
ERROR_LINE = re.compile(r"^(?P<path>[^:\s]+\.py):\d+(?::\d+)?: error: .*\[(?P<code>[a-z0-9-]+)\]\s*$")

Key = tuple[str, str]


def run_mypy() -> tuple[Counter[Key], dict[Key, list[str]]]:
    """Runs mypy from the repository root; returns error counts and the error lines per (file, code)."""
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", "--no-color-output"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    counts: Counter[Key] = Counter()
    lines: dict[Key, list[str]] = {}
    for line in proc.stdout.splitlines():
        m = ERROR_LINE.match(line)
        if m:
            key = (m["path"], m["code"])
            counts[key] += 1
            lines.setdefault(key, []).append(line)
    # mypy exits 1 with errors and 2 when it could not run at all (bad config, crash): only the latter is fatal here
    if proc.returncode not in (0, 1) or (proc.returncode == 1 and not counts):
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"check_types: mypy failed to run (exit {proc.returncode})")
    return counts, lines


def read_baseline() -> Counter[Key]:
    counts: Counter[Key] = Counter()
    if not BASELINE.exists():
        return counts
    for n, raw in enumerate(BASELINE.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 3 or not parts[0].isdigit():
            raise SystemExit(f"check_types: {BASELINE.name}:{n}: expected 'COUNT PATH CODE', got {raw!r}")
        counts[(parts[1], parts[2])] = int(parts[0])
    return counts


def write_baseline(counts: Counter[Key]) -> None:
    body = "".join(f"{n} {path} {code}\n" for (path, code), n in sorted(counts.items()) if n > 0)
    header = (
        "# mypy errors allowed per file and error code (scripts/check_types.py). This file may only shrink:\n"
        "# fix errors, then run scripts/check_types.py --update.\n"
    )
    BASELINE.write_text(header + body)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--update", action="store_true", help="lower the baseline to today's counts")
    args = parser.parse_args()
    current, lines = run_mypy()
    baseline = read_baseline()
    grown = {k: n for k, n in current.items() if n > baseline.get(k, 0)}
    shrunk = {k: n for k, n in baseline.items() if current.get(k, 0) < n}
    total, allowed = sum(current.values()), sum(baseline.values())
    if grown:
        print(f"check_types: new mypy errors ({total} now, baseline allows {allowed}):")
        for key in sorted(grown):
            print(f"  {key[0]} [{key[1]}]: {current[key]} (baseline {baseline.get(key, 0)})")
            for line in lines[key]:
                print(f"    {line}")
        print("Fix them (or, where mypy is wrong, a narrow `# type: ignore[code]` saying why).")
        return 1
    if args.update:
        write_baseline(current)
        print(f"check_types: baseline lowered from {allowed} to {total} errors")
        return 0
    if shrunk:
        print(
            f"check_types: ok, {total} errors, {allowed - total} fewer than the baseline: "
            "run scripts/check_types.py --update and commit scripts/mypy_baseline.txt"
        )
    else:
        print(f"check_types: ok, {total} errors (baseline {allowed})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
