"""`lichen port-slime SCRIPT.sh`: a slime launch script -> a lichen YAML config, the flag table, and a dry run.

The script is evaluated, not run (lichen.port_slime.script, lichen.port_slime.bash_eval): its train.py flags, as bash
would pass them for this environment and `--assume NAME=VALUE`, are classified (lichen.config.slime.compat); what
cannot be evaluated is listed, one line per cause, and stops the conversion (exit 2). slime always runs train.py as
a Ray job, so the config is `--runtime ray` with slime's placement (`--runtime local` on request). The YAML holds lichen's flags only: slime's own flags with lichen's
spelling, the tokens a mapped flag stands for, and the Ray runtime env vars as `train-env-vars`; every flag left
out is in the table, written as comments at the top of the file, so nothing is dropped silently. Then the same
flags are dry-run in this process (`lichen train --dry-run`, the Megatron model flags compared with config.json),
and the exit code is the dry run's: 0, or 2 naming every flag that stops the run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import yaml

from lichen.config import build_train_parser, parse_train_args
from lichen.config.checks import is_torch_dist
from lichen.config.parser import option_actions
from lichen.config.slime import compat as slime_compat
from lichen.config.slime.flags import ENTRY_POINTS, MAPPED
from lichen.errors import ConfigError
from lichen.observe.secrets import is_secret_name, redact_text
from lichen.port_slime.bash_values import Assumptions
from lichen.port_slime.script import ScriptNotEvaluated, SlimeCommand, read_script

# slime's train_async.py is lichen train with this flag (ENTRY_POINTS' row says so)
ASYNC_FLAG = "--async"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lichen port-slime",
        description="Convert a slime launch script (scripts/run-*.sh) into a lichen YAML config plus a table of what "
        "lichen does with each flag, then dry-run it. Variables the script does not set come from the environment.",
    )
    parser.add_argument("script", metavar="SCRIPT.sh", help="the slime launch script")
    parser.add_argument(
        "-o",
        "--output",
        metavar="FILE.yaml",
        default=None,
        help="where the config goes (default: SCRIPT's name with .yaml, in the current directory)",
    )
    parser.add_argument("--no-dry-run", action="store_true", help="write the config and the table only")
    parser.add_argument(
        "--assume",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a variable's value where port-slime cannot compute it (a command's output, a branch it cannot "
        "decide) and in the environment; '-f PATH=true' answers a file test. Repeatable",
    )
    parser.add_argument(
        "--runtime",
        choices=("ray", "local"),
        default="ray",
        help="ray (default: slime runs train.py as a Ray job; its placement flags place lichen's actors) or local "
        "(one process; slime's placement flags are then listed as not applicable)",
    )
    parser.add_argument(
        "--ref-load-is-hf-checkpoint",
        action="store_true",
        help="the script's --ref-load is a Megatron torch_dist conversion of its --hf-checkpoint model (slime's "
        "usual workflow: convert_hf_to_torch_dist.py): the config then leaves --ref-load out, so the reference and "
        "the starting weights are the --hf-checkpoint model. Without it a torch_dist --ref-load stops the dry run, "
        "since lichen reads only Hugging Face checkpoints",
    )
    opts = parser.parse_args(argv)
    try:
        command = read_script(opts.script, assume=Assumptions.parse(opts.assume))
    except ScriptNotEvaluated as e:
        print(f"lichen port-slime: {opts.script}: nothing written; port-slime cannot evaluate:", file=sys.stderr)
        for item in e.items:
            print(f"  {redact_text(item.message())}", file=sys.stderr)
        return 2
    output = opts.output or os.path.splitext(os.path.basename(opts.script))[0] + ".yaml"
    known = _known_flags()
    train_argv = command.argv + _env_tokens(command)
    rows = extra_rows(command)
    if command.entry == "train_async.py":
        train_argv.append(ASYNC_FLAG)
    train_argv += _runtime_tokens(command, opts.runtime, rows)
    if opts.ref_load_is_hf_checkpoint:
        train_argv = ref_load_from_hf(train_argv, rows)
    found = slime_compat.scan(train_argv, known, rows)
    text = render_yaml(command, found)
    with open(output, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {output} from {command.script} ({command.entry}, {command.where})")
    for line in env_report(command):
        print(line)
    if opts.no_dry_run:
        print(slime_compat.table(found.rows))
        return 0
    parse_train_args(train_argv + ["--dry-run"], show_table=print, extra_rows=rows)
    print(f"dry run: every flag resolves; run it with: lichen train --config {output}")
    return 0


def ref_load_from_hf(argv: list[str], rows: list[slime_compat.Row]) -> list[str]:
    """argv without a torch_dist `--ref-load` (the user said it holds the --hf-checkpoint model), with a row saying
    so. slime starts the actor from --ref-load when --load holds no checkpoint, and its reference model is
    --ref-load: both are lichen's defaults from --hf-checkpoint. An HF --ref-load is kept as it is."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, inline = token.partition("=")
        if name == "--ref-load" and (eq or i + 1 < len(argv)):
            path = inline if eq else argv[i + 1]
            step = 1 if eq else 2
            if is_torch_dist(path):
                rows.append(
                    slime_compat.Row(
                        "--ref-load",
                        [path],
                        MAPPED,
                        "(left out: the --hf-checkpoint model)",
                        "port-slime --ref-load-is-hf-checkpoint: this torch_dist checkpoint is the --hf-checkpoint "
                        "model converted for Megatron; lichen's reference and starting weights default to it",
                    )
                )
                i += step
                continue
        out.append(token)
        i += 1
    return out


def _known_flags() -> set[str]:
    return {s for s in option_actions(build_train_parser()) if s.startswith("--")}


def _env_tokens(command: SlimeCommand) -> list[str]:
    """Ray's runtime env vars (`ray job submit --runtime-env-json`) become --train-env-vars, whose row in the
    table shows them, unless the script already sets that flag."""
    if not command.env_vars or "--train-env-vars" in command.argv:
        return []
    return ["--train-env-vars", json.dumps(command.env_vars)]


def env_report(command: SlimeCommand) -> list[str]:
    """The environment variables the config sets (never silently): Ray's env_vars of the script's command."""
    if not command.env_vars:
        return ["environment variables the config adds: none (the script's ray job sets none)"]
    lines = [f"environment variables the config adds (train-env-vars, from --runtime-env-json at {command.where}):"]
    return lines + [f"  {redact_text(f'{k}={v}')}" for k, v in command.env_vars.items()]


def _runtime_tokens(command: SlimeCommand, runtime: str, rows: list[slime_compat.Row]) -> list[str]:
    """`--runtime ray` (slime's own runtime: its placement flags keep their meaning) with slime's SGLang engines,
    or nothing for `--runtime local` (slime_compat then maps the placement for one process)."""
    how = "a Ray job (`ray job submit`)" if command.ray_job else "Ray (train.py starts it)"
    if runtime == "local":
        rows.append(
            slime_compat.Row(
                "(runtime)",
                [],
                MAPPED,
                "--runtime local",
                f"asked for with port-slime --runtime local; slime runs train.py as {how}",
            )
        )
        return []
    rows.append(
        slime_compat.Row(
            "(runtime)",
            [],
            MAPPED,
            "--runtime ray",
            f"slime runs train.py as {how}: trainer ranks = --actor-num-nodes x --actor-num-gpus-per-node, engines "
            "on --rollout-num-gpus (colocated: the trainer's GPUs), --rollout-num-gpus-per-engine each",
        )
    )
    tokens = ["--runtime", "ray"]
    given = {t.split("=")[0] for t in command.argv if t.startswith("--")}
    wants_sglang = "--rollout-num-gpus-per-engine" in given or any(f.startswith("--sglang-") for f in given)
    engine_flags = {"--rollout-num-engines", "--rollout-engine-backend", "--rollout-external-engine-addrs"}
    if wants_sglang and not given & engine_flags:
        tokens += ["--rollout-engine-backend", "sglang"]
        if "--debug-train-only" in given:  # Ray places no engines then; lichen's checks still want their count
            tokens += _engine_count(command.argv)
        rows.append(
            slime_compat.Row(
                "(rollout engines)",
                [],
                MAPPED,
                "--rollout-engine-backend sglang",
                "slime's engines are SGLang servers, rollout GPUs / GPUs per engine of them; lichen's Ray actors "
                "launch the same",
            )
        )
    return tokens


def _engine_count(argv: list[str]) -> list[str]:
    """`--rollout-num-engines K` as placement computes it: rollout GPUs (colocated: the trainer's) / per engine."""

    def value(flag: str, default: int | None) -> int | None:
        for i, token in enumerate(argv):
            if token == flag and i + 1 < len(argv) and argv[i + 1].isdigit():
                return int(argv[i + 1])
            if token.startswith(flag + "=") and token.split("=", 1)[1].isdigit():
                return int(token.split("=", 1)[1])
        return default

    gpus = value("--rollout-num-gpus", None)
    if gpus is None and "--colocate" in argv:
        gpus = (value("--actor-num-nodes", 1) or 1) * (value("--actor-num-gpus-per-node", 1) or 1)
    per_engine = value("--rollout-num-gpus-per-engine", 1) or 1
    return [] if gpus is None else ["--rollout-num-engines", str(max(1, gpus // per_engine))]


def extra_rows(command: SlimeCommand) -> list[slime_compat.Row]:
    """Rows for what is not a train.py flag: the entry point, unset variables."""
    rule = ENTRY_POINTS[command.entry]
    rows = [slime_compat.Row(command.entry, [], rule.cls, rule.lichen, rule.reason)]
    for name in command.unset_vars:
        rows.append(
            slime_compat.Row(
                f"${name}",
                [],
                MAPPED,
                "(empty)",
                f"{name} is set neither in the script nor in the environment: it expanded to nothing, as in bash",
            )
        )
    return rows


def render_yaml(command: SlimeCommand, found: slime_compat.Scan) -> str:
    """The YAML config of the lichen tokens of `found`, the table above it as comments."""
    actions = option_actions(build_train_parser())
    config: dict = {}
    dropped: list[str] = []
    for flag, values in _flags(found.kept):
        key = flag[2:]
        if is_secret_name(key):  # a secret never goes into a file: the environment holds it
            dropped.append(f"{flag}: a secret; set it in the environment (WANDB_API_KEY for --wandb-key)")
            continue
        config[key] = _yaml_value(actions.get(flag), flag, values)
        if flag.startswith("--no-") and key in config and flag in actions and config[key] is False:
            config[key[3:]] = config.pop(key)
    header = [f"lichen config ported from {command.script} ({command.entry}) by `lichen port-slime`", ""]
    header += slime_compat.table(found.rows).splitlines()
    header += [f"left out: {d}" for d in dropped]
    return "".join(f"# {line}\n" if line else "#\n" for line in header) + yaml.safe_dump(
        config, sort_keys=False, default_flow_style=False
    )


def _flags(tokens: list[str]) -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    for token in tokens:
        if token.startswith("--"):
            name, eq, value = token.partition("=")
            out.append((name, [value] if eq else []))
        elif out:
            out[-1][1].append(token)
        else:
            raise ConfigError(f"unexpected word {token!r} before the first flag of the train.py command")
    return out


def _yaml_value(action: argparse.Action | None, flag: str, values: list[str]):
    if flag == "--train-env-vars" and values:
        return json.loads(values[0])
    if action is None:  # an --sglang-* pass-through flag
        return True if not values else values[0] if len(values) == 1 else values
    if isinstance(action, argparse.BooleanOptionalAction):
        return not flag.startswith("--no-")
    if action.nargs == 0:
        return True
    if action.nargs in ("*", "+") or isinstance(action.nargs, int):
        return [_number_or_text(v) for v in values]
    return _number_or_text(values[0]) if values else None


def _number_or_text(text: str):
    """Numbers as YAML numbers (readable; each value is parsed by its flag's own type when the config loads)."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
