"""`lichen report RUN_DIR [-o report.html]`."""

from __future__ import annotations

import argparse
import os

from lichen.observe.report.data import collect
from lichen.observe.report.page import render


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="lichen report",
        description="Write a run directory (the --output-dir of `lichen train`) as one self-contained HTML page: "
        "curves, step time by phase, memory per phase, a sample browser (--log-samples), the config and the "
        "checkpoints. It needs no network to open; run it again to refresh the page of a run still going.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's --output-dir (holds metrics.jsonl)")
    p.add_argument(
        "-o", "--output", metavar="FILE", default=None, help="where to write the page (default: RUN_DIR/report.html)"
    )
    args = p.parse_args(argv)
    out = args.output or os.path.join(args.run_dir, "report.html")
    page = render(collect(args.run_dir))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(page)
    os.replace(tmp, out)  # a browser reloading the page never reads half of it
    print(f"wrote {out} ({len(page) / 1024:.0f} KiB)")
    return 0
