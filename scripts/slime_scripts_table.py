#!/usr/bin/env python3
"""The per-script table of docs/slime-compat.md ("Every slime launch script"): `lichen port-slime` on every
`scripts/run-*.sh` and `scripts/low_precision/run-*.sh` of a slime checkout, each in one invocation (conversion and
dry run), without and with `--ref-load-is-hf-checkpoint`.

For each script a scratch `$B` holds a copy of slime's `scripts/` with `/root` replaced by `$B` (and a link
`scripts/scripts -> .`, the path the low-precision and reproducibility scripts source, which slime's tree lacks),
plus what the dry run reads, written by lichen.port_slime.trial_base: `$B/<model>/config.json` of the dimensions
the script's `MODEL_ARGS` state (as lichen's bash evaluator computes them, mapped through the checked-flag table,
with the released model's model_type) and a tiny tokenizer, torch_dist-shaped `--ref-load` / `--load` directories,
one-prompt data files. Every script gets the same `--assume` set (a value a script does not ask for changes
nothing). Prints the markdown table; slime's files are read at run time and never kept.

Usage: scripts/slime_scripts_table.py SLIME [--work DIR] [--only GLOB]
  SLIME: a slime checkout, a directory holding `scripts/`, or a bare git mirror (its HEAD is read)
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing lichen

import lichen.cli  # noqa: E402
from lichen.config.slime.flags_data import CLASSES  # noqa: E402
from lichen.port_slime.bash_values import Assumptions  # noqa: E402
from lichen.port_slime.trial_base import mismatches, populate, read_inputs  # noqa: E402

TOKENIZER = ROOT / "tests" / "fixtures" / "slime" / "tokenizer"
HF_REF = "--ref-load-is-hf-checkpoint"
# the column headers of the classes, in the table's order
SHORT = {
    "not applicable (FSDP2 sharding)": "n/a shard",
    "not applicable (no effect on results)": "n/a effect",
    "not available yet": "not yet",
}
_STOP_ROW = re.compile(r"^ +[^|]+\| (?P<flag>\S+)(?P<values>[^|]*)\|.*\[STOPS THE RUN\]$", re.M)
_ROOT = re.compile(r"/root(?![\w.-])")


def assumes(base: str) -> list[str]:
    """The --assume set of docs/slime-compat.md's command, for scratch dir `base`."""
    return [
        "NVLINK_COUNT=8",
        "NUM_GPUS=8",
        f"BASE_DIR={base}",
        f"BASE_FOLDER={base}",
        "MASTER_ADDR=127.0.0.1",
        "RAY_ADDRESS=http://127.0.0.1:8265",
        f"SGLANG_CONFIG_FILE={base}/sglang.yaml",
    ]


@dataclass
class Outcome:
    """One port-slime invocation: exit code, rows per class, what stopped it."""

    rc: int
    counts: dict[str, int] = field(default_factory=dict)
    stops: list[str] = field(default_factory=list)


@dataclass
class Result:
    script: str
    model_type: str
    plain: Outcome
    hf_ref: Outcome
    notes: list[str] = field(default_factory=list)


def extract(slime: str, dest: str) -> str:
    """slime's `scripts/` under `dest`; returns that directory."""
    out = os.path.join(dest, "scripts")
    if os.path.isdir(os.path.join(slime, "scripts")):
        shutil.copytree(os.path.join(slime, "scripts"), out, symlinks=False)
        return out
    if os.path.isfile(os.path.join(slime, "HEAD")):  # a bare git repository
        archive = subprocess.run(
            ["git", "--git-dir", slime, "archive", "HEAD", "scripts"], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
        return out
    raise SystemExit(f"{slime}: neither a directory with scripts/ nor a git repository")


def run_scripts(scripts_dir: str) -> list[str]:
    """The launch scripts, relative to `scripts_dir`: run-*.sh and low_precision/run-*.sh, sorted."""
    found = []
    for sub in ("low_precision", ""):
        folder = os.path.join(scripts_dir, sub)
        if os.path.isdir(folder):
            found += [os.path.join(sub, n) if sub else n for n in os.listdir(folder) if fnmatch.fnmatch(n, "run-*.sh")]
    return sorted(found)


def copy_scripts(scripts_dir: str, base: str) -> str:
    """`scripts_dir` copied to `base`/scripts with `/root` replaced by `base`, plus the `scripts/scripts` link."""
    out = os.path.join(base, "scripts")
    shutil.copytree(scripts_dir, out)
    for folder, _dirs, files in os.walk(out):
        for name in files:
            if name.endswith(".sh"):
                path = os.path.join(folder, name)
                text = Path(path).read_text(encoding="utf-8")
                Path(path).write_text(_ROOT.sub(base, text), encoding="utf-8")
    os.symlink(".", os.path.join(out, "scripts"))
    return out


def port(script: str, base: str, extra: list[str]) -> Outcome:
    """`lichen port-slime SCRIPT` in this process, in `base`; the exit code, counts and stops it printed."""
    argv = ["port-slime", script, "-o", "out.yaml"] + [a for s in assumes(base) for a in ("--assume", s)] + extra
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(base)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = lichen.cli.main(argv)
    except Exception as e:  # a bug of lichen's, not a verdict: the table says so instead of stopping
        return Outcome(-1, stops=[f"crash: {type(e).__name__}: {e}"])
    finally:
        os.chdir(cwd)
    return parse(rc, out.getvalue(), err.getvalue(), base)


def parse(rc: int, out: str, err: str, base: str) -> Outcome:
    """The counts line, the flags marked [STOPS THE RUN], and an error that is not a flag's row."""
    counts: dict[str, int] = {}
    m = re.search(r"^counts: (.*)$", out, re.M)
    if m:
        for part in m.group(1).split(", "):
            cls, _, n = part.rpartition(": ")
            counts[cls] = int(n)
    rows = [m for m in _STOP_ROW.finditer(out)]
    stops = list(dict.fromkeys(_stop_name(m.group("flag"), m.group("values")) for m in rows))
    for line in err.splitlines() if rc != 0 else []:
        if "error:" not in line:
            continue
        # lichen's one-line error: the flags' stops (the rows above), then "; also: " the first other problem
        for part in line.split("error:", 1)[1].strip().split("; also: "):
            # a stop row's own message (its paths may differ by a doubled /) is not a second stop
            if "flags stop this run" not in part and not any(
                _same_path(part)[:60] in _same_path(m.group(0)) for m in rows
            ):
                if not any(part.startswith(m.group("flag")) for m in rows):
                    stops.append(_brief(part.replace(base, "$B")))
    return Outcome(rc, counts, stops)


def _same_path(text: str) -> str:
    return re.sub(r"/{2,}", "/", text)


def _stop_name(flag: str, values: str) -> str:
    """A stopping row as the table names it: the flag; the model type's row with its value."""
    return f"`{flag}` {values.strip()}" if flag == "model_type" else f"`{flag}`"


def _brief(why: str) -> str:
    """A stop that is not a flag row, in a few words (the table's cells stay short)."""
    if "torch_dist" in why and why.startswith("--ref-load"):
        return "torch_dist `--ref-load`"
    return why if len(why) <= 140 else why[:137] + "..."


def measure(scripts_dir: str, rel: str, work: str, tokenizer: str) -> Result:
    base = os.path.join(work, rel.replace("/", "_").removesuffix(".sh"))
    os.makedirs(base)
    copy = copy_scripts(scripts_dir, base)
    script = os.path.join(copy, rel)
    inputs = read_inputs(script, Assumptions.parse(assumes(base)))
    config = populate(inputs, base, tokenizer)
    notes = [] if inputs.model_args else ["no MODEL_ARGS at the train.py command"]
    if config is not None:  # the built config.json must match every checked flag it was built from
        notes += [f"config.json: {m}" for m in mismatches(inputs.model_args, config)]
    if inputs.model_type is None:
        notes.append(f"no model_type known for {inputs.model_files or 'the script (it sources no model file)'}")
    plain = port(script, base, [])
    hf_ref = port(script, base, [HF_REF])
    return Result(rel, inputs.model_type or "-", plain, hf_ref, notes)


def markdown(results: list[Result]) -> str:
    """The table: script, model_type, exit code without / with --ref-load-is-hf-checkpoint, rows per class,
    the stops of each."""
    head = ["script", "model_type", "rc", f"rc `{HF_REF}`"] + [SHORT.get(c, c) for c in CLASSES]
    head += ["stops", f"stops with `{HF_REF}`"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [f"`{r.script}`", r.model_type, str(r.plain.rc), str(r.hf_ref.rc)]
        cells += [str(r.plain.counts.get(c, 0)) for c in CLASSES]
        cells += [_stops(r.plain), "same" if r.hf_ref.stops == r.plain.stops else _stops(r.hf_ref)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _stops(outcome: Outcome) -> str:
    return ", ".join(s for s in outcome.stops if s).replace("|", "\\|") or "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("slime", help="slime checkout, directory holding scripts/, or bare git mirror")
    parser.add_argument("--work", help="scratch directory, kept (default: a temporary one, removed)")
    parser.add_argument("--only", default="*", metavar="GLOB", help="scripts whose relative path matches GLOB")
    parser.add_argument("--tokenizer", default=str(TOKENIZER), help="tokenizer files copied into each model dir")
    opts = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        work = opts.work or stack.enter_context(tempfile.TemporaryDirectory(prefix="slime-table-"))
        work = os.path.abspath(work)
        os.makedirs(work, exist_ok=True)
        source = os.path.join(work, "_slime")
        os.makedirs(source)
        scripts_dir = extract(os.path.abspath(opts.slime), source)
        results = [
            measure(scripts_dir, rel, work, opts.tokenizer)
            for rel in run_scripts(scripts_dir)
            if fnmatch.fnmatch(rel, opts.only)
        ]
    print(markdown(results))
    for r in results:  # what the table cannot show: a model file the scratch config does not reproduce
        for note in r.notes:
            print(f"{r.script}: {note}", file=sys.stderr)
    return 1 if any(r.notes for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
