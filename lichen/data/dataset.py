"""Prompt data sets: JSON Lines or Parquet files, optionally cut to a row range with `path@[a:b]`.

Each row becomes a `PromptRecord`. The prompt (`--input-key`) is either a string or a list of chat messages
(`{"role": ..., "content": ...}` dicts). The label (`--label-key`) may be anything JSON can hold; a row without
it gets label None. Metadata (`--metadata-key`) must be an object (a JSON string holding an object is also
accepted, since Parquet files often store it that way).

The slice suffix follows Python slice semantics over data rows (blank lines in a JSONL file are not rows):
`data.jsonl@[:100]` is the first 100 rows, `data.jsonl@[-50:]` the last 50, `data.parquet@[10:-10]` all but
ten at each end. Only the selected rows are parsed, so a malformed line outside the slice is not reported.

Every selected row is checked when the file loads, before any model loads (a bad row found mid-run would
kill the run at that step, and again on every resume): a line that is not UTF-8 or not a JSON object, a
missing or empty prompt, bad metadata or tools, JSON nested deeper than 100 levels, a string holding a lone
UTF-16 surrogate (valid JSON, not valid Unicode: it would fail later, when the prompt is encoded or sent). The
first bad row is a DataError naming FILE:LINE (exit 2); with `skip_bad_rows` (--skip-bad-rows) each bad row is
logged and left out, and their count is logged.

A data file is hostile input: a JSONL line longer than `max_row_bytes` (--max-row-bytes) is never held whole; it
is read past in bounded chunks and dropped with a warning naming FILE:LINE, so one huge row cannot exhaust the
host's memory (the prompt-length bound before tokenizing is in lichen.data.fit).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Iterator

from lichen.errors import DataError

logger = logging.getLogger(__name__)

_SLICE_RE = re.compile(r"^(?P<path>.+)@\[(?P<body>[^\]]*)\]$")
_JSONL_EXTS = (".jsonl", ".json")
_PARQUET_EXTS = (".parquet",)
# deeper JSON is no prompt data set's shape, and nested values are walked recursively later (copies, checkpoints)
MAX_ROW_DEPTH = 100
_SURROGATE_RE = re.compile("[\ud800-\udfff]")
_SKIP_CHUNK = 1 << 20  # bytes read at a time past an over-long line


@dataclass
class PromptRecord:
    prompt: str | list[dict]
    label: Any
    metadata: dict = field(default_factory=dict)
    tools: list | None = None
    source_line: int | None = None  # 1-based line (JSONL) or row (Parquet) in the source file


def parse_spec(spec: str, flag: str = "--prompt-data") -> tuple[str, slice | None]:
    """Split `path@[a:b]` into the path and a `slice`; a spec without the suffix gives (spec, None)."""
    m = _SLICE_RE.match(spec)
    if m is None:
        if "@[" in spec:
            raise DataError(
                f"{flag} {spec!r}: bad row slice; write it as PATH@[start:stop], e.g. data.jsonl@[:100] or "
                f"data.jsonl@[-50:]"
            )
        return spec, None
    body = m.group("body")
    parts = body.split(":")
    if len(parts) != 2:
        raise DataError(
            f"{flag} {spec!r}: bad row slice [{body}]; expected exactly one ':' as in [start:stop] (no step)"
        )
    bounds: list[int | None] = []
    for part in parts:
        part = part.strip()
        if part == "":
            bounds.append(None)
            continue
        try:
            bounds.append(int(part))
        except ValueError:
            raise DataError(
                f"{flag} {spec!r}: bad row slice [{body}]; {part!r} is not an integer (bounds are whole row "
                f"numbers, negative counts from the end, empty means the start/end)"
            ) from None
    return m.group("path"), slice(bounds[0], bounds[1])


def load_prompt_dataset(
    spec: str,
    *,
    input_key: str = "prompt",
    label_key: str | None = "label",
    metadata_key: str | None = "metadata",
    tool_key: str | None = None,
    flag: str = "--prompt-data",
    skip_bad_rows: bool = False,
    max_row_bytes: int | None = None,
) -> list[PromptRecord]:
    """Read the prompt rows of `spec` (`.jsonl`/`.json` lines or `.parquet`, optional `@[a:b]`) into records;
    a bad row raises DataError naming it, or with `skip_bad_rows` is logged and left out. A JSONL line over
    `max_row_bytes` (None: no cap) is dropped with a warning naming FILE:LINE, without being read into memory."""
    path, row_slice = parse_spec(spec, flag)
    if not os.path.exists(path):
        raise DataError(f"{flag} {path}: file not found; check the path (relative paths start at {os.getcwd()})")
    if os.path.isdir(path):
        raise DataError(f"{flag} {path}: is a directory; give a .jsonl or .parquet file")
    lower = path.lower()
    if lower.endswith(_JSONL_EXTS):
        rows = _read_jsonl(path, row_slice, max_row_bytes)
    elif lower.endswith(_PARQUET_EXTS):
        rows = _read_parquet(path, row_slice, flag)
    else:
        ext = os.path.splitext(path)[1] or "(none)"
        raise DataError(
            f"{flag} {path}: unsupported file extension {ext}; use .jsonl (one JSON object per line), .json "
            f"(JSON Lines) or .parquet"
        )
    if not rows:
        where = f" after slicing [{_fmt_slice(row_slice)}]" if row_slice is not None else ""
        raise DataError(f"{flag} {spec}: no prompt rows{where}; the data set must hold at least one prompt")
    keys = _Keys(input_key, label_key, metadata_key, tool_key)
    records, bad, oversize = [], 0, 0
    for line, row in rows:
        if isinstance(row, _Oversize):
            oversize += 1
            logger.warning(
                "%s: dropped a row of %d bytes, over --max-row-bytes %d (never read whole; raise "
                "--max-row-bytes if the row is meant to be used)",
                row_where(path, line),
                row.size,
                max_row_bytes,
            )
            continue
        try:
            if isinstance(row, DataError):
                raise row
            records.append(_to_record(row, line, path, keys))
        except DataError as e:
            if not skip_bad_rows:
                raise DataError(f"{e}{bad_row_hint(flag)}") from None
            bad += 1
            logger.warning("%s: skipping bad row: %s", flag, e)
    if bad:
        logger.warning("%s %s: skipped %d bad row(s) of %d (--skip-bad-rows)", flag, spec, bad, len(rows))
    if oversize:
        logger.warning("%s %s: dropped %d row(s) over --max-row-bytes %d", flag, spec, oversize, max_row_bytes)
    if not records and oversize:
        raise DataError(f"{flag} {spec}: none of the {len(rows)} rows is usable ({oversize} over --max-row-bytes)")
    if not records:
        raise DataError(f"{flag} {spec}: all {len(rows)} rows are bad (--skip-bad-rows left none); see the log")
    return records


def bad_row_hint(flag: str) -> str:
    """What to do about a bad row; --skip-bad-rows applies to --prompt-data only (eval data stays strict)."""
    return "; fix the row, or pass --skip-bad-rows to leave bad rows out" if flag == "--prompt-data" else ""


def row_where(path: str, line: int) -> str:
    """How a row is named in messages: FILE:LINE for JSON Lines, FILE row N for Parquet."""
    return f"{path}:{line}" if path.lower().endswith(_JSONL_EXTS) else f"{path} row {line}"


@dataclass
class _Keys:
    input: str
    label: str | None
    metadata: str | None
    tool: str | None


def _fmt_slice(s: slice | None) -> str:
    if s is None:
        return ":"
    return f"{'' if s.start is None else s.start}:{'' if s.stop is None else s.stop}"


@dataclass
class _Oversize:
    """A line longer than the row cap: only its size is kept."""

    size: int


def _read_jsonl(
    path: str, row_slice: slice | None, max_row_bytes: int | None
) -> list[tuple[int, dict | DataError | _Oversize]]:
    """(1-based line number, parsed object, the DataError that line is, or _Oversize) for each selected non-blank
    line."""
    # bytes, decoded line by line: one line that is not UTF-8 is a bad row, not a UnicodeDecodeError traceback
    with open(path, "rb") as f:
        lines = list(_capped_lines(f, max_row_bytes))
    if row_slice is not None:
        lines = lines[row_slice]
    return [(lineno, raw if isinstance(raw, _Oversize) else _parse_line(path, lineno, raw)) for lineno, raw in lines]


def _capped_lines(f: BinaryIO, cap: int | None) -> Iterator[tuple[int, bytes | _Oversize]]:
    """(1-based line number, the line, or _Oversize when it holds more than `cap` bytes) for each non-blank line.
    An over-long line is read past in `_SKIP_CHUNK` pieces, so at most `cap` + 1 bytes of it are ever held."""
    lineno = 0
    while True:
        raw = f.readline(-1 if cap is None else cap + 1)
        if not raw:
            return
        lineno += 1
        if cap is not None and len(raw) > cap and not raw.endswith(b"\n"):
            size, blank = len(raw), not raw.strip()
            del raw
            while True:
                chunk = f.readline(_SKIP_CHUNK)
                size += len(chunk)
                blank = blank and not chunk.strip()
                if not chunk or chunk.endswith(b"\n"):
                    break
            if not blank:
                yield lineno, _Oversize(size)
        elif raw.strip():
            yield lineno, raw


def _parse_line(path: str, lineno: int, raw: bytes) -> dict | DataError:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return DataError(
            f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the "
            "line); save the file as UTF-8"
        )
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        hint = ""
        if lineno == 1 and text.lstrip().startswith("["):
            hint = "; the file looks like one JSON array, but lichen reads JSON Lines (one object per line)"
        return DataError(f"{path}:{lineno}: malformed JSON: {e.msg} (column {e.colno}){hint}")
    except RecursionError:
        return DataError(f"{path}:{lineno}: JSON nested too deeply (at most {MAX_ROW_DEPTH} levels)")
    except ValueError as e:  # e.g. an integer of more digits than int() converts
        return DataError(f"{path}:{lineno}: unreadable JSON value: {str(e)[:200]}")
    if not isinstance(obj, dict):
        return DataError(
            f"{path}:{lineno}: expected a JSON object per line, got {type(obj).__name__}; each line must be "
            f'like {{"prompt": ..., "label": ...}}'
        )
    return obj


def _check_tree(row: dict, where: str) -> None:
    """Refuse a row nested deeper than MAX_ROW_DEPTH or holding a string with a lone surrogate (walked
    iteratively, so the check itself cannot overflow the stack)."""
    stack: list[tuple[Any, int, str]] = [(row, 1, "")]
    while stack:
        value, depth, at = stack.pop()
        if isinstance(value, str):
            m = _SURROGATE_RE.search(value)
            if m is not None:
                raise DataError(
                    f"{where}: the string at {at or 'the top'} holds a lone UTF-16 surrogate "
                    f"(\\u{ord(m.group()):04x} at character {m.start() + 1}), which is not valid Unicode; fix the "
                    "text (usually half of an escaped emoji pair was cut off)"
                )
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_ROW_DEPTH:
            raise DataError(f"{where}: nested deeper than {MAX_ROW_DEPTH} levels at {at}; flatten the row")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            key = f"{at}[{k!r}]"  # repr: a hostile key (a surrogate, a newline) stays printable in the message
            if isinstance(k, str):
                stack.append((k, depth, f"key of {key[:80]}"))
            stack.append((v, depth + 1, key[:200]))


def _read_parquet(path: str, row_slice: slice | None, flag: str) -> list[tuple[int, dict]]:
    """(1-based row number, row dict) for each selected row."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and friends for non-parquet content
        raise DataError(f"{flag} {path}: cannot read as Parquet: {e}") from None
    start, stop, _ = (row_slice or slice(None)).indices(table.num_rows)
    stop = max(start, stop)
    table = table.slice(start, stop - start)
    return [(start + i + 1, row) for i, row in enumerate(table.to_pylist())]


def _to_record(row: dict, line: int, path: str, keys: _Keys) -> PromptRecord:
    where = row_where(path, line)
    _check_tree(row, where)
    if keys.input not in row or row[keys.input] is None:
        present = ", ".join(repr(k) for k in row) or "(none)"
        raise DataError(
            f"{where}: no prompt under key {keys.input!r} (keys present: {present}); set --input-key to the "
            f"key that holds the prompt"
        )
    prompt = _check_prompt(row[keys.input], where, keys.input)
    label = row.get(keys.label) if keys.label is not None else None
    metadata: dict = {}
    if keys.metadata is not None and row.get(keys.metadata) is not None:
        metadata = _check_object(row[keys.metadata], where, keys.metadata, "metadata")
    tools = None
    if keys.tool is not None and row.get(keys.tool) is not None:
        tools = row[keys.tool]
        if isinstance(tools, str):
            try:
                tools = json.loads(tools)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: tools under key {keys.tool!r} is a string but not JSON: {e.msg}") from None
        if not isinstance(tools, list):
            raise DataError(
                f"{where}: tools under key {keys.tool!r} must be a list of tool specs, got {type(tools).__name__}"
            )
    return PromptRecord(prompt=prompt, label=label, metadata=metadata, tools=tools, source_line=line)


def _check_object(value: Any, where: str, key: str, what: str) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
    if not isinstance(value, dict):
        raise DataError(f"{where}: {what} under key {key!r} must be an object, got {type(value).__name__}")
    return value


def _check_prompt(value: Any, where: str, key: str) -> str | list[dict]:
    """A prompt is a string or a non-empty list of {role: str, content: str | list | None} messages."""
    if isinstance(value, str):
        if not value:  # an engine refuses an empty prompt ("input_ids cannot be empty")
            raise DataError(f"{where}: the prompt under key {key!r} is an empty string")
        return value
    if not isinstance(value, list):
        raise DataError(
            f"{where}: prompt under key {key!r} must be a string or a list of chat messages, got {type(value).__name__}"
        )
    if not value:
        raise DataError(f"{where}: prompt under key {key!r} is an empty message list")
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise DataError(
                f"{where}: message {i} of the prompt under key {key!r} must be an object with 'role' and "
                f"'content', got {type(msg).__name__}"
            )
        if not isinstance(msg.get("role"), str):
            raise DataError(
                f"{where}: message {i} of the prompt under key {key!r} has no string 'role' (keys: "
                f"{', '.join(map(repr, msg)) or '(none)'})"
            )
        if "content" not in msg:
            raise DataError(f"{where}: message {i} of the prompt under key {key!r} has no 'content'")
        content = msg["content"]
        # list content = multimodal parts; None = an assistant turn that only calls tools
        if not (content is None or isinstance(content, (str, list))):
            raise DataError(
                f"{where}: message {i} of the prompt under key {key!r}: 'content' must be a string, a list of "
                f"parts or null, got {type(content).__name__}"
            )
    return value
