"""`lichen <command> …`: the console entry point.

Each subcommand lives in its own module exposing `main(argv: list[str]) -> int`; it is imported only when used,
so `lichen --help` stays fast. A `UserError` anywhere becomes one `lichen <command>: error: …` line and exit
code 2; a `RunError` (the run started but cannot go on) the same line with exit code 1. Both messages pass through
the secret redaction of `lichen.observe.secrets`.
"""

from __future__ import annotations

import importlib
import sys

from lichen.errors import RunError, UserError
from lichen.observe.secrets import redact_text

COMMANDS = {
    "train": ("lichen.train_cli", "run the RL loop: rollout -> train -> weight sync"),
    "make-tiny-model": ("lichen.models.tiny", "write a small random-init HF checkpoint with a character tokenizer"),
    "eval": ("lichen.eval_cli", "evaluate a checkpoint on eval data sets (pass@k, mean reward), no training"),
    "serve": ("lichen.engines.server.serve", "serve a model over SGLang's HTTP protocol"),
    "report": ("lichen.observe.report.cli", "write a run directory as one self-contained HTML page (curves, samples)"),
    "port-slime": ("lichen.port_slime", "convert a slime launch script to a lichen config + flag table, dry-run it"),
    "bench": ("lichen_bench", "benchmarks that print ratios against a baseline measured in the same run"),
}

USAGE = (
    "usage: lichen <command> [options]\n\ncommands:\n"
    + "\n".join(f"  {name:<18} {helptext}" for name, (_, helptext) in COMMANDS.items())
    + "\n\nRun `lichen <command> --help` for the options of a command."
)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] in ("-V", "--version"):
        from lichen import __version__

        print(f"lichen {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"lichen: error: unknown command {name!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(COMMANDS[name][0])
        return int(module.main(rest) or 0)
    except UserError as e:
        print(f"lichen {name}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"lichen {name}: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"lichen {name}: interrupted", file=sys.stderr)
        return 130


def _one_line(error: Exception) -> str:
    """The message on one line (an engine's answer may carry newlines), secrets redacted."""
    return redact_text(" | ".join(line.strip() for line in str(error).splitlines() if line.strip()))


if __name__ == "__main__":
    sys.exit(main())
