"""Every flag of one `lichen train` invocation classified in one pass, so a slime script learns everything at once.

argparse stops at the first flag it does not know; a slime launch script carries dozens of Megatron flags, so
`scan` runs first: it takes the flags of `slime_flags.SLIME_FLAGS` (and unknown and removed ones) out of argv,
adds the lichen tokens a mapped flag stands for, and records one `Row` per flag. After argparse, `finish` applies
the mappings that need parsed values and compares the "checked" flags with config.json. `table` renders the
rows; `blocking_message` names every row that stops the run.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
from collections import Counter
from dataclasses import dataclass, field

from lichen.config.removed import removed_message
from lichen.config.slime.flags import (
    BLOCKING,
    CHECKED,
    CLASSES,
    DEFAULT_DIFFERS,
    DIFFERS_CLASS,
    ENTRY_POINTS,
    HINT_CUTOFF,
    MAPPED,
    NOT_YET,
    RAY_PLACEMENT,
    RAY_PLACEMENT_LOCAL,
    REMOVED,
    SAME,
    SLIME_FLAGS,
    UNKNOWN,
    VALUE_ALIASES,
    FlagRule,
    differs_note,
)
from lichen.config.slime.megatron_model import check_flag
from lichen.observe.secrets import is_secret_name
from lichen.plugins import slime_alias

SGLANG_PREFIX = "--sglang-"
_QUIET = {"--dry-run", "--config"}
# lichen's own controls of this invocation: not slime flags to classify


@dataclass
class Row:
    """One flag of the invocation: its class, what lichen does with it, and a note (reason, check, difference)."""

    flag: str
    values: list[str]
    cls: str
    lichen: str
    note: str
    blocking: bool = False  # a checked flag whose weight shape disagrees stops the run too

    @property
    def stops(self) -> bool:
        return self.blocking or self.cls in BLOCKING


@dataclass
class Scan:
    """argv for argparse (slime-only flags taken out, mapped tokens added) and one row per flag."""

    kept: list[str]
    rows: list[Row] = field(default_factory=list)

    @property
    def slime(self) -> bool:
        """Whether slime/Megatron flags were given: only then is the table printed."""
        return any(
            r.flag in SLIME_FLAGS
            or r.flag in VALUE_ALIASES
            and r.cls == MAPPED
            or r.flag.endswith(".py")
            or r.flag == "(rollout engines)"
            or r.cls == RAY_PLACEMENT_LOCAL.cls
            for r in self.rows
        )

    def values(self, flag: str) -> list[str] | None:
        for row in self.rows:
            if row.flag == flag:
                return row.values
        return None


def _take_values(argv: list[str], i: int) -> tuple[list[str], int]:
    """The tokens after argv[i] up to the next `--flag`: lichen takes no positional arguments, so they are the
    flag's values (`-1` is a value)."""
    j = i + 1
    while j < len(argv) and not argv[j].startswith("--"):
        j += 1
    return argv[i + 1 : j], j


def scan(argv: list[str], known_flags: set[str], extra_rows: list[Row] | None = None) -> Scan:
    """Classify every `--flag` of argv; `known_flags` are lichen's own option strings."""
    out = Scan(kept=[], rows=list(extra_rows or []))
    local = _runtime(argv) != "ray"
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            out.kept += argv[i:]
            break
        if not token.startswith("--"):
            out.kept.append(token)
            i += 1
            continue
        name, eq, inline = token.partition("=")
        values, j = ([inline], i + 1) if eq else _take_values(argv, i)
        if local and name in RAY_PLACEMENT:
            out.kept += _foreign(name, values, known_flags, out)
        elif name in known_flags or name.startswith((SGLANG_PREFIX, "--vllm-")):  # pass-through (lichen.config.rollout)
            out.kept += _lichen_tokens(name, token, values, eq, out, local)
        else:
            out.kept += _foreign(name, values, known_flags, out)
        i = j
    _slime_sft(out)
    out.kept += _slime_ci(out)
    if local:
        out.kept += _slime_engines(out)
    if out.slime:  # a slime script that leaves a flag out gets lichen's default: say where it is not slime's
        given = {r.flag for r in out.rows}
        out.rows += [
            Row(flag, [], DIFFERS_CLASS, "lichen's default", note)
            for flag, note in DEFAULT_DIFFERS.items()
            if flag not in given
        ]
    return out


def _runtime(argv: list[str]) -> str | None:
    for i, token in enumerate(argv):
        if token == "--runtime" and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith("--runtime="):
            return token.split("=", 1)[1]
    return None


def _slime_engines(out: Scan) -> list[str]:
    """slime's rollout engines are SGLang servers it launches, rollout GPUs / GPUs per engine of them; lichen
    launches the same with --rollout-engine-backend sglang --rollout-num-engines K, unless lichen's own engine
    flags are given."""
    given = {r.flag for r in out.rows}
    per_engine = out.values("--rollout-num-gpus-per-engine")
    wants_sglang = per_engine is not None or any(f.startswith(SGLANG_PREFIX) for f in given)
    if not wants_sglang or given & {
        "--rollout-num-engines",
        "--rollout-engine-backend",
        "--rollout-external-engine-addrs",
    }:
        return []
    rollout_gpus = out.values("--rollout-num-gpus")
    nodes, per_node = out.values("--actor-num-nodes"), out.values("--actor-num-gpus-per-node")
    try:
        if rollout_gpus:
            gpus = int(rollout_gpus[0])
        elif "--colocate" in given and per_node:
            gpus = int(nodes[0] if nodes else 1) * int(per_node[0])
        else:
            return []
        engines = max(1, gpus // int(per_engine[0] if per_engine else 1))
    except (ValueError, IndexError):
        return []
    out.rows.append(
        Row(
            "(rollout engines)",
            [],
            MAPPED,
            f"--rollout-engine-backend sglang --rollout-num-engines {engines}",
            f"slime launches {gpus} rollout GPUs / {per_engine[0] if per_engine else 1} "
            "per engine SGLang servers; so does lichen",
        )
    )
    return ["--rollout-engine-backend", "sglang", "--rollout-num-engines", str(engines)]


def _lichen_tokens(name: str, token: str, values: list[str], eq: str, out: Scan, local: bool) -> list[str]:
    aliases = VALUE_ALIASES.get(name, {})
    if values and values[0] in aliases:
        lichen_value = aliases[values[0]]
        out.rows.append(
            Row(name, values, MAPPED, f"{name} {lichen_value}", f"slime's {values[0]} is lichen's {lichen_value}")
        )
        return [f"{name}={lichen_value}"] if eq else [name, lichen_value] + values[1:]
    alias = slime_alias(values[0]) if name in PLUGIN_PATH_FLAGS and values else None
    if alias is not None:
        lichen = f"{name} {alias.target}" if alias.target else f"{name} left out"
        out.rows.append(Row(name, values, MAPPED, lichen, f"slime's function; lichen's: {alias.instead}"))
    elif name.startswith(SGLANG_PREFIX):
        out.rows.append(Row(name, values, SAME, "passed to the SGLang servers lichen launches", ""))
    elif name not in _QUIET:
        note = differs_note(name, values, local=local)
        out.rows.append(Row(name, values, DIFFERS_CLASS if note else SAME, name, note))
    return [token] if eq else [token] + values


def _foreign(name: str, values: list[str], known_flags: set[str], out: Scan) -> list[str]:
    """Row for a flag lichen does not define; returns the lichen tokens it maps to."""
    rule = classify(name, set())
    if rule.cls == UNKNOWN:
        close = difflib.get_close_matches(name, sorted(known_flags), n=1, cutoff=HINT_CUTOFF)
        hint = f"; did you mean {close[0]}?" if close else "; see lichen train --help"
        out.rows.append(Row(name, values, UNKNOWN, "", f"unrecognized argument {name}{hint}"))
        return []
    row = Row(name, values, rule.cls, rule.lichen, rule.reason)
    out.rows.append(row)
    return [] if rule.cls == REMOVED else _map(row, rule, out)


def _map(row: Row, rule: FlagRule, out: Scan) -> list[str]:
    """The lichen tokens of a mapped flag; a value lichen cannot run turns the row into "not available yet"."""
    value = row.values[0] if row.values else ""
    if row.flag in ("--attention-dropout", "--hidden-dropout") and _number(value) != 0.0:
        _not_yet(row, f"dropout {value}: lichen's models have no dropout; use 0.0")
    elif row.flag == "--recompute-granularity":
        return ["--gradient-checkpointing"]
    elif row.flag == "--optimizer" and value != "adam":
        _not_yet(row, f"--optimizer {value}: lichen's optimizer is AdamW; use adam")
    elif row.flag == "--wandb-exp-name" and value:
        return ["--wandb-run-name", value]
    elif row.flag == "--ci-test":
        return ["--check-weight-update-equal"]
    return []


# lichen flags that take a dotted plug-in path; slime's own paths there are aliased (lichen.plugins.SLIME_ALIASES)
PLUGIN_PATH_FLAGS = (
    "--rollout-function-path",
    "--eval-function-path",
    "--custom-rm-path",
    "--custom-generate-function-path",
    "--dynamic-sampling-filter-path",
)
_SFT_ROLLOUT = "lichen.rollout.sft.generate_rollout"


def _slime_sft(out: Scan) -> None:
    """slime's --debug-train-only means "no rollout engines": training on replayed dumps, or (its SFT script) on
    what a rollout function that generates nothing returns. lichen's flag is the first only; for the second the
    flag is dropped, since lichen's SFT rollout uses no engine output. train_async.py overlaps nothing there
    (the SFT rollout only reads data), so it runs the synchronous loop with the same steps."""
    skip = _row_of(out, "--disable-compute-advantages-and-returns")
    if skip is not None and (out.values("--loss-type") or ["policy_loss"])[0] == "policy_loss":
        _not_yet(skip, "skipping advantages with --loss-type policy_loss is not built (sft_loss / custom_loss do)")
    row = _row_of(out, "--debug-train-only")
    path = (out.values("--rollout-function-path") or [""])[0]
    alias = slime_alias(path)
    sft = (alias.target if alias is not None else path) == _SFT_ROLLOUT
    if row is not None and out.values("--load-debug-rollout-data") is not None:
        row.cls, row.note = SAME, ""  # replaying dumps: slime's meaning
    elif row is not None and sft:
        row.cls, row.lichen = MAPPED, "left out: the SFT rollout generates nothing"
        row.note = "slime: training only, no SGLang engines; lichen's SFT rollout reads the data the same way"
        out.kept.remove("--debug-train-only")
    entry = _row_of(out, "train_async.py")
    if sft and entry is not None and "--async" in out.kept:
        out.kept.remove("--async")
        out.rows = [r for r in out.rows if r.flag != "--async"]
        entry.cls, entry.lichen = MAPPED, "lichen train (synchronous)"
        entry.note = (
            "the SFT rollout only reads data, so there is no generation to overlap: the synchronous loop gives the "
            f"same steps ({ENTRY_POINTS['train_async.py'].lichen} needs engines)"
        )


# slime's default of --ci-train-rollout-logprob-abs-diff-threshold, asserted under --ci-test
CI_LOGPROB_THRESHOLD = "0.1"
_CI_THRESHOLD_FLAG = "--ci-train-rollout-logprob-abs-diff-threshold"


def _slime_ci(out: Scan) -> list[str]:
    """slime's --ci-test asserts train/train_rollout_logprob_abs_diff <= its threshold flag (default 0.1): lichen's
    flag of that name does the check, so --ci-test sets slime's default unless the script gives the flag."""
    if _row_of(out, "--ci-test") is None or _row_of(out, _CI_THRESHOLD_FLAG) is not None:
        return []
    return [_CI_THRESHOLD_FLAG, CI_LOGPROB_THRESHOLD]


def _not_yet(row: Row, why: str) -> None:
    row.cls = NOT_YET
    row.note = why


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def finish(out: Scan, args: argparse.Namespace) -> None:
    """After argparse: mappings that need parsed values, and the "checked" comparison with config.json."""
    _check_model(out, args)


def _row(out: Scan, flag: str) -> Row:
    return next(r for r in out.rows if r.flag == flag)


def _row_of(out: Scan, flag: str) -> Row | None:
    return next((r for r in out.rows if r.flag == flag), None)


SAME_REASON = "lichen's flag of slime's name and meaning"


def classify(flag: str, known_flags: set[str], *, local: bool = True) -> FlagRule:
    """The class of one flag by its name alone, with the reason: the row `scan` gives it before its values are
    looked at (a value can still turn a row into "not available yet", e.g. `--optimizer sgd`)."""
    if local and flag in RAY_PLACEMENT:
        return RAY_PLACEMENT_LOCAL
    if flag in known_flags:
        note = differs_note(flag, [], local=local)
        return FlagRule(DIFFERS_CLASS, flag, note) if note else FlagRule(SAME, flag, SAME_REASON)
    if flag.startswith(SGLANG_PREFIX):
        return FlagRule(SAME, "passed to the SGLang servers lichen launches", "SGLang's own server flag")
    removed = removed_message(flag)
    if removed is not None:
        return FlagRule(REMOVED, "drop it", removed)
    return SLIME_FLAGS.get(flag) or FlagRule(UNKNOWN, "", f"unrecognized argument {flag}")


def _check_model(out: Scan, args: argparse.Namespace) -> None:
    checked = [r for r in out.rows if r.cls == CHECKED]
    if not checked:
        return
    hf_dir = args.hf_checkpoint
    config = _read_config(hf_dir)
    if config is None:
        for row in checked:
            row.note = "not compared: no readable config.json under --hf-checkpoint"
        return
    _model_type_row(out, config, args)
    for row in checked:
        row.note, row.blocking = check_flag(row.flag, row.values, config, hf_dir or "")


def _model_type_row(out: Scan, config: dict, args: argparse.Namespace) -> None:
    """A row for a model type outside lichen's own code: the generic HF path runs it (mapped), or nothing can (not
    available yet, with the model check's reason)."""
    from lichen.errors import ConfigError
    from lichen.models.config import SUPPORTED_MODEL_TYPES
    from lichen.models.hf_support import check_loadable

    model_type = config.get("model_type")
    if model_type in SUPPORTED_MODEL_TYPES and args.model_impl != "hf":
        return
    try:
        impl = check_loadable(
            config, f"{args.hf_checkpoint}/config.json", impl=args.model_impl, trust_remote_code=args.trust_remote_code
        )
    except ConfigError as e:
        out.rows.append(Row("model_type", [str(model_type)], NOT_YET, ", ".join(SUPPORTED_MODEL_TYPES), str(e)))
        return
    if impl == "hf":
        out.rows.append(
            Row(
                "model_type",
                [str(model_type)],
                MAPPED,
                "--model-impl hf (transformers' AutoModelForCausalLM)",
                f"lichen's own code covers {', '.join(SUPPORTED_MODEL_TYPES)}; "
                "this type runs on the generic HF path (docs/models.md)",
            )
        )


def _read_config(hf_dir: str | None) -> dict | None:
    if not hf_dir:
        return None
    try:
        with open(os.path.join(hf_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def counts(rows: list[Row]) -> dict[str, int]:
    """Rows per class, in table order, for every class present."""
    n = Counter(r.cls for r in rows)
    return {cls: n[cls] for cls in CLASSES if n[cls]}


def table(rows: list[Row]) -> str:
    """The class table: one line per flag grouped by class, then the counts."""
    lines = ["slime/Megatron flags (class | flag values | lichen | note):"]
    for cls in CLASSES:
        for r in (r for r in rows if r.cls == cls):
            values = ["<redacted>"] * len(r.values) if is_secret_name(r.flag.lstrip("-")) else r.values
            shown = " ".join([r.flag] + [_short(v) for v in values])
            mark = " [STOPS THE RUN]" if r.stops else ""
            lines.append(f"  {cls} | {shown} | {r.lichen} | {r.note}{mark}".rstrip(" |"))
    lines.append("counts: " + ", ".join(f"{cls}: {k}" for cls, k in counts(rows).items()))
    return "\n".join(lines)


def _short(value: str) -> str:
    return value if len(value) <= 60 else value[:57] + "..."


def blocking_message(rows: list[Row]) -> str | None:
    """One line naming every row that stops the run (its own message when it is the only one), or None."""
    stops = [r for r in rows if r.stops]
    if not stops:
        return None
    if len(stops) == 1:
        return _why(stops[0])
    return f"{len(stops)} flags stop this run (see the table): " + "; ".join(_why(r) for r in stops)


def _why(row: Row) -> str:
    """Removed and unknown notes already name the flag."""
    return row.note if row.cls in (REMOVED, UNKNOWN) or row.note.startswith(row.flag) else f"{row.flag}: {row.note}"
