"""Hostile data rows (issue 33): a huge row is dropped naming FILE:LINE without being read whole or tokenized past
--max-prompt-chars; deep nesting and lone surrogates are one FILE:LINE error, not a traceback."""

from __future__ import annotations

import json
import logging
import tracemalloc
import types

import pytest
from helpers.rollout import rollout_worker
from helpers.runs import base_args

from lichen.config import parse_train_args
from lichen.data import PromptRecord, load_prompt_dataset
from lichen.data.fit import fit_prompts, prompt_chars
from lichen.errors import DataError, PromptTooLong
from lichen.models.tokenizer import encode_prompt, load_tokenizer

HUGE = 50 << 20  # bytes of the huge row


def write_rows(path, rows_before: int, huge_prompt_bytes: int, rows_after: int) -> str:
    """`rows_before` small rows, one row whose prompt is `huge_prompt_bytes` of 'x', then `rows_after` small rows;
    the huge row is written in pieces so the test itself never holds it."""
    with open(path, "w") as f:
        for i in range(rows_before):
            f.write(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n")
        f.write('{"prompt": "')
        piece = "x" * (1 << 20)
        for _ in range(huge_prompt_bytes >> 20):
            f.write(piece)
        f.write('", "label": "0"}\n')
        for i in range(rows_after):
            f.write(json.dumps({"prompt": f"{i}+2=", "label": str(i + 2)}) + "\n")
    return str(path)


def test_huge_row_is_dropped_unread_with_bounded_memory(tmp_path, caplog):
    path = write_rows(tmp_path / "d.jsonl", 2, HUGE, 2)
    cap = 1 << 20
    tracemalloc.start()
    try:
        with caplog.at_level("WARNING", logger="lichen.data.dataset"):
            recs = load_prompt_dataset(path, max_row_bytes=cap)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [r.source_line for r in recs] == [1, 2, 4, 5]
    warned = [r.getMessage() for r in caplog.records]
    assert any(
        w.startswith(f"{path}:3: dropped a row of {HUGE + 29} bytes, over --max-row-bytes {cap}") for w in warned
    )
    # the 50 MB line was never held: at most the cap plus the skip chunk and bookkeeping
    assert peak < 4 * cap, peak


def test_over_long_blank_line_is_no_row(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n' + b" " * 5000 + b'\n{"prompt": "b"}\n')
    assert [r.source_line for r in load_prompt_dataset(str(path), max_row_bytes=100)] == [1, 3]
    # a last line exactly at the cap, without a newline, is kept
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "bb"}')
    assert [r.prompt for r in load_prompt_dataset(str(path), max_row_bytes=16)] == ["a", "bb"]


def test_prompt_chars_counts_text_only():
    assert prompt_chars("abc") == 3
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "image_url", "image_url": "x" * 999}]},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "cde"},
    ]
    assert prompt_chars(msgs) == 5


def test_fit_never_tokenizes_past_the_character_bound(caplog):
    seen: list[int] = []

    def encode(i, record):
        seen.append(len(record.prompt))
        return [1] * len(record.prompt)

    records = [PromptRecord(prompt="x" * n, label=None, source_line=i + 1) for i, n in enumerate([3, 2_000_000, 4])]
    with caplog.at_level("WARNING", logger="lichen.data.fit"):
        kept = fit_prompts(records, encode, path="d.jsonl", max_prompt_len=5, skip_bad_rows=False, max_prompt_chars=160)
    assert [r.source_line for r in kept] == [1, 3] and seen == [3, 4]
    warned = [r.getMessage() for r in caplog.records]
    assert any(
        "d.jsonl:2: dropped the prompt renders to 2000000 characters, over --max-prompt-chars 160" in w for w in warned
    )


class CountingTokenizer:
    """The real tokenizer, recording the length of every text it is asked to encode."""

    def __init__(self, inner):
        self.inner = inner
        self.encoded: list[int] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, text, **kw):
        self.encoded.append(len(text))
        return self.inner.encode(text, **kw)


def test_rendered_chat_prompt_is_bounded_before_tokenizing(tiny_ckpt):
    tok = CountingTokenizer(load_tokenizer(tiny_ckpt))
    many_empty = [{"role": "user", "content": ""} for _ in range(5000)]  # no text of its own, long when rendered
    with pytest.raises(PromptTooLong):
        encode_prompt(tok, many_empty, True, max_chars=1000)
    big_tools = [{"type": "function", "function": {"name": "f", "description": "d" * 5000}}]
    with pytest.raises(PromptTooLong):
        encode_prompt(tok, "hi", True, big_tools, max_chars=1000)
    assert tok.encoded == []
    assert encode_prompt(tok, "hi", True, max_chars=1000) and tok.encoded and tok.encoded[0] <= 1000


def test_rollout_worker_drops_huge_rows_without_tokenizing_them(tiny_ckpt, tmp_path, monkeypatch, caplog):
    """The product path: the flags' defaults (32 MiB rows, 32 x --rollout-max-prompt-len characters) on a file with
    a 50 MB row, a 200k-character row and a chat row that renders long; the tokenizer never sees over the bound."""
    data = tmp_path / "d.jsonl"
    write_rows(data, 4, HUGE, 0)
    with open(data, "a") as f:
        f.write(json.dumps({"prompt": "y" * 200_000, "label": "0"}) + "\n")
        f.write(json.dumps({"prompt": [{"role": "user", "content": ""}] * 3000, "label": "0"}) + "\n")
    import lichen.rollout.manager as manager

    counting: list[CountingTokenizer] = []

    def load(path, **kw):
        counting.append(CountingTokenizer(load_tokenizer(path, **kw)))
        return counting[0]

    monkeypatch.setattr(manager, "load_tokenizer", load)
    argv = base_args(
        tiny_ckpt, str(data), tmp_path / "out", "--apply-chat-template", "--num-rollout", "1", "--debug-rollout-only"
    )
    args = parse_train_args(argv[1:])
    bound = args.max_prompt_chars
    assert bound == 32 * args.rollout_max_prompt_len and args.max_row_bytes == 32 << 20
    engine = types.SimpleNamespace(close=lambda: None)
    with caplog.at_level(logging.WARNING, logger="lichen.data"):
        worker = rollout_worker(args, engine=engine)
    assert len(worker.data_source.source.records) == 4 and worker.num_filtered_prompts == 2
    assert counting[0].encoded and max(counting[0].encoded) <= bound
    warned = [r.getMessage() for r in caplog.records]
    for line in (5, 6, 7):
        assert any(f"{data}:{line}: dropped" in w for w in warned), (line, warned)


@pytest.mark.parametrize(
    "line, match",
    [
        ('{"prompt": "a", "label": ' + "[" * 100_000 + "]" * 100_000 + "}", r"d.jsonl:2: JSON nested too deeply"),
        ('{"prompt": "a", "label": ' + "[" * 150 + "]" * 150 + "}", r"d.jsonl:2: nested deeper than 100 levels"),
        ('{"prompt": "caf\\ud800"}', r"d.jsonl:2: the string at \['prompt'\] holds a lone UTF-16 surrogate \(\\ud800"),
        ('{"prompt": "a", "m\\udfff": 1}', r"d.jsonl:2: the string at key of \['m\\udfff'\] holds a lone"),
        ('{"prompt": "a", "label": 1' + "0" * 5000 + "}", r"d.jsonl:2: unreadable JSON value"),
    ],
)
def test_hostile_json_is_one_named_error(tmp_path, line, match):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(DataError, match=match):
        load_prompt_dataset(str(path))
    assert [r.prompt for r in load_prompt_dataset(str(path), skip_bad_rows=True)] == ["ok"]
