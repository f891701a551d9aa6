"""Prompt data sets (JSONL / Parquet, row slices, error messages) and the resumable prompt source."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lichen.data import PromptRecord, PromptSource, load_prompt_dataset
from lichen.errors import ConfigError, DataError

ROWS = [
    {"prompt": "12+35=", "label": 47, "metadata": {"task": "add"}},
    {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}], "label": "4"},
    {"prompt": "no label here", "metadata": {"task": "free"}},
    {"prompt": "3+4=", "label": 7, "tools": [{"name": "calc"}]},
    {"prompt": "5+5=", "label": 10, "metadata": None},
]


def write_jsonl(path, rows, blank_after: int | None = None) -> str:
    with open(path, "w") as f:
        for i, row in enumerate(rows):
            f.write(json.dumps(row) + "\n")
            if blank_after is not None and i == blank_after:
                f.write("\n   \n")
    return str(path)


def write_parquet(path, rows) -> str:
    # from_pylist takes its columns from the first row only; use the union so sparse keys survive
    keys = list(dict.fromkeys(k for row in rows for k in row))
    pq.write_table(pa.Table.from_pydict({k: [row.get(k) for row in rows] for k in keys}), path)
    return str(path)


def strip_nones(x):
    """Parquet gives every struct the union of keys (absent ones as None); compare up to that."""
    if isinstance(x, dict):
        return {k: strip_nones(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [strip_nones(v) for v in x]
    return x


# --------------------------------------------------------------------------------------------- loading


def test_jsonl_fields(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS, blank_after=1)
    recs = load_prompt_dataset(path, tool_key="tools")
    assert len(recs) == 5
    assert recs[0] == PromptRecord("12+35=", 47, {"task": "add"}, None, 1)
    assert recs[1].prompt[1] == {"role": "user", "content": "2+2?"} and recs[1].label == "4"
    assert recs[1].metadata == {}
    assert recs[2].label is None  # label missing in the row
    assert recs[3].tools == [{"name": "calc"}]
    assert recs[4].metadata == {}  # null metadata
    # the blank lines after row 2 are not rows, but line numbers still count them
    assert [r.source_line for r in recs] == [1, 2, 5, 6, 7]


def test_jsonl_and_parquet_load_the_same(tmp_path):
    jl = load_prompt_dataset(write_jsonl(tmp_path / "d.jsonl", ROWS), tool_key="tools")
    pa_ = load_prompt_dataset(write_parquet(tmp_path / "d.parquet", ROWS[:1] + ROWS[2:]), tool_key="tools")
    jl = jl[:1] + jl[2:]  # the chat row would make the prompt column mixed-type in Arrow; checked separately
    assert len(pa_) == len(jl)
    for a, b in zip(jl, pa_):
        assert (a.prompt, a.label, a.metadata, a.tools) == (
            b.prompt,
            b.label,
            strip_nones(b.metadata),
            strip_nones(b.tools),
        )
    assert [r.source_line for r in pa_] == [1, 2, 3, 4]


def test_parquet_chat_prompts(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "label": str(i)} for i in range(4)]
    recs = load_prompt_dataset(write_parquet(tmp_path / "c.parquet", rows))
    assert [r.prompt for r in recs] == [row["prompt"] for row in rows]
    assert [r.label for r in recs] == ["0", "1", "2", "3"]
    assert load_prompt_dataset(write_jsonl(tmp_path / "c.jsonl", rows)) == recs


def test_custom_keys_and_json_extension(tmp_path):
    rows = [{"question": "q1", "answer": "a1", "extra": {"k": 1}}, {"question": "q2", "answer": "a2"}]
    path = write_jsonl(tmp_path / "d.json", rows)
    recs = load_prompt_dataset(path, input_key="question", label_key="answer", metadata_key="extra")
    assert [(r.prompt, r.label, r.metadata) for r in recs] == [("q1", "a1", {"k": 1}), ("q2", "a2", {})]
    recs = load_prompt_dataset(path, input_key="question", label_key=None, metadata_key=None)
    assert [(r.label, r.metadata) for r in recs] == [(None, {}), (None, {})]


def test_metadata_as_json_string(tmp_path):
    path = write_parquet(tmp_path / "m.parquet", [{"prompt": "p", "metadata": json.dumps({"rm_type": "math"})}])
    assert load_prompt_dataset(path)[0].metadata == {"rm_type": "math"}


# ---------------------------------------------------------------------------------------------- slicing


@pytest.mark.parametrize(
    "suffix", ["", "@[:]", "@[:3]", "@[-2:]", "@[1:-1]", "@[2:4]", "@[-4:-1]", "@[3:100]", "@[-100:2]", "@[ 1 : 3 ]"]
)
@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_slices_match_python(tmp_path, suffix, fmt):
    rows = [{"prompt": f"p{i}", "label": i} for i in range(6)]
    path = (write_jsonl if fmt == "jsonl" else write_parquet)(tmp_path / f"d.{fmt}", rows)
    recs = load_prompt_dataset(path + suffix)
    want = eval(f"list(range(6))[{suffix[2:-1] or ':'}]") if suffix else list(range(6))
    assert [r.label for r in recs] == want
    assert [r.source_line for r in recs] == [i + 1 for i in want]


def test_slice_skips_bad_lines_outside_it(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{oops\n')
    assert [r.prompt for r in load_prompt_dataset(f"{path}@[:2]")] == ["a", "b"]


@pytest.mark.parametrize(
    "suffix,needle",
    [
        ("@[a:b]", "'a' is not an integer"),
        ("@[1:2:3]", "exactly one ':'"),
        ("@[5]", "exactly one ':'"),
        ("@[1:", "bad row slice"),
    ],
)
def test_bad_slice_syntax(tmp_path, suffix, needle):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(DataError, match=r"--prompt-data") as e:
        load_prompt_dataset(path + suffix)
    assert needle in str(e.value)


@pytest.mark.parametrize("suffix", ["@[5:]", "@[3:1]", "@[-1:-1]"])
def test_empty_after_slice(tmp_path, suffix):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(DataError, match=r"no prompt rows after slicing"):
        load_prompt_dataset(path + suffix)


def test_empty_file(tmp_path):
    path = tmp_path / "e.jsonl"
    path.write_text("\n\n")
    with pytest.raises(DataError, match="no prompt rows"):
        load_prompt_dataset(str(path))


# ----------------------------------------------------------------------------------------------- errors


def test_missing_file_names_flag_and_path(tmp_path):
    with pytest.raises(DataError) as e:
        load_prompt_dataset(str(tmp_path / "nope.jsonl@[:10]"), flag="--eval-prompt-data")
    msg = str(e.value)
    assert msg.startswith("--eval-prompt-data ") and "nope.jsonl: file not found" in msg


def test_unsupported_extension(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("prompt,label\n")
    with pytest.raises(DataError, match=r"d\.csv: unsupported file extension \.csv"):
        load_prompt_dataset(str(path))


def test_malformed_json_names_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b",}\n')
    with pytest.raises(DataError) as e:
        load_prompt_dataset(str(path))
    msg = str(e.value)
    assert msg.startswith(f"{path}:3: malformed JSON: ") and "column" in msg


def test_json_array_file_gets_a_hint(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[\n{"prompt": "a"}\n]\n')
    with pytest.raises(DataError, match="JSON Lines"):
        load_prompt_dataset(str(path))


def test_non_object_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a"}\n["prompt"]\n')
    with pytest.raises(DataError, match=rf"{path}:2: expected a JSON object per line, got list"):
        load_prompt_dataset(str(path))


def test_missing_input_key_lists_keys(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, {"question": "b", "label": 1}])
    with pytest.raises(DataError) as e:
        load_prompt_dataset(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:2: no prompt under key 'prompt'")
    assert "keys present: 'question', 'label'" in msg and "--input-key" in msg


def test_missing_input_key_parquet_row(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", [{"prompt": "a"}, {"prompt": None}])
    with pytest.raises(DataError, match=rf"{path} row 2: no prompt under key 'prompt'"):
        load_prompt_dataset(path)


def test_metadata_must_be_object(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "meta": {}}, {"prompt": "b", "meta": [1]}])
    with pytest.raises(DataError, match=rf"{path}:2: metadata under key 'meta' must be an object, got list"):
        load_prompt_dataset(path, metadata_key="meta")


@pytest.mark.parametrize(
    "prompt,needle",
    [
        (5, "must be a string or a list of chat messages, got int"),
        ([], "empty message list"),
        (["hi"], "message 0 .* must be an object"),
        ([{"role": "user", "content": "a"}, {"content": "b"}], "message 1 .* no string 'role'"),
        ([{"role": "user"}], "message 0 .* has no 'content'"),
        ([{"role": "user", "content": 3}], "'content' must be a string"),
    ],
)
def test_bad_chat_prompt(tmp_path, prompt, needle):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ok"}, {"prompt": prompt}])
    with pytest.raises(DataError, match=rf"{path}:2: .*{needle}"):
        load_prompt_dataset(path)


def test_tools_must_be_list(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "tools": {"name": "x"}}])
    with pytest.raises(DataError, match=rf"{path}:1: tools under key 'tools' must be a list"):
        load_prompt_dataset(path, tool_key="tools")


def test_empty_prompt_is_a_bad_row_at_load(tmp_path):
    rows = [{"prompt": f"{i}+1=", "label": i + 1} for i in range(200)]
    rows[49]["prompt"] = ""
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(
        DataError,
        match=rf"^{path}:50: the prompt under key 'prompt' is an empty string; fix the row, "
        "or pass --skip-bad-rows",
    ):
        load_prompt_dataset(path)
    got = load_prompt_dataset(path, skip_bad_rows=True)
    assert len(got) == 199 and all(r.prompt for r in got) and 50 not in [r.source_line for r in got]


def test_skip_bad_rows_logs_each_and_the_count(tmp_path, caplog):
    path = tmp_path / "d.jsonl"
    path.write_bytes(
        b'{"prompt": "a"}\n{"prompt": ""}\n{"prompt": "b",}\n\xff\xfe{"prompt": "c"}\n[1]\n'
        b'{"prompt": "d", "metadata": [1]}\n{"question": "e"}\n{"prompt": "f"}\n'
    )
    with caplog.at_level("WARNING", logger="lichen.data.dataset"):
        got = load_prompt_dataset(str(path), skip_bad_rows=True)
    assert [r.prompt for r in got] == ["a", "f"]
    warned = [r.getMessage() for r in caplog.records]
    for line in range(2, 8):
        assert any(f"{path}:{line}:" in w for w in warned), (line, warned)
    assert warned[-1].endswith("skipped 6 bad row(s) of 8 (--skip-bad-rows)")
    path.write_text('{"prompt": ""}\n')
    with pytest.raises(DataError, match="all 1 rows are bad"):
        load_prompt_dataset(str(path), skip_bad_rows=True)


def test_non_utf8_line_is_named(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')  # Latin-1, not UTF-8
    with pytest.raises(DataError, match=rf"^{path}:2: not UTF-8 text \(byte 0xe9 at byte 16 of the line\)"):
        load_prompt_dataset(str(path))


def test_eval_data_errors_do_not_suggest_skip_bad_rows(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": ""}])
    with pytest.raises(DataError) as e:
        load_prompt_dataset(path, flag="eval data set 'x'")
    assert "--skip-bad-rows" not in str(e.value)


def test_fit_prompts_drops_long_ones_and_names_empty_encodings(tmp_path, caplog):
    from lichen.data.fit import fit_prompts

    records = [PromptRecord(prompt="x" * n, label=None, source_line=i + 1) for i, n in enumerate([3, 9, 5, 0])]
    encode = lambda i, r: [7] * len(r.prompt)  # noqa: E731
    with pytest.raises(DataError, match=r"d.jsonl:4: the prompt encodes to no tokens.*--skip-bad-rows"):
        fit_prompts(records, encode, path="d.jsonl", max_prompt_len=5, skip_bad_rows=False)
    with caplog.at_level("WARNING", logger="lichen.data.fit"):
        kept = fit_prompts(records, encode, path="d.jsonl", max_prompt_len=5, skip_bad_rows=True)
    assert [r.source_line for r in kept] == [1, 3]
    assert any(
        "dropped 1 of 4 prompts longer than --rollout-max-prompt-len 5" in r.getMessage() for r in caplog.records
    )
    with pytest.raises(DataError, match="none of the 4 prompts fits"):
        fit_prompts(records, encode, path="d.jsonl", max_prompt_len=2, skip_bad_rows=True)


# ------------------------------------------------------------------------------------------ prompt source


def recs(n: int) -> list[PromptRecord]:
    return [PromptRecord(prompt=f"p{i}", label=i, metadata={}) for i in range(n)]


def ids(batch) -> list[int]:
    assert all(r.label == i for i, r in batch)  # the index points at the record handed out
    return [i for i, _ in batch]


def test_too_small_dataset():
    with pytest.raises(DataError, match=r"data set has 3 prompts but --rollout-batch-size is 4"):
        PromptSource(recs(3), batch_size=4, shuffle=False, seed=0)
    with pytest.raises(ConfigError, match="--rollout-batch-size"):
        PromptSource(recs(3), batch_size=0, shuffle=False, seed=0)


def test_sequential_batches_straddle_epochs():
    src = PromptSource(recs(5), batch_size=2, shuffle=False, seed=0)
    assert src.num_batches_per_epoch == 2 and len(src) == 5
    got = []
    for _ in range(5):
        got.append(ids(src.next_batch()))
    assert got == [[0, 1], [2, 3], [4, 0], [1, 2], [3, 4]]
    assert (src.epoch, src.offset) == (2, 0)
    src.next_batch()
    assert (src.epoch, src.offset) == (2, 2)


def test_batch_equal_to_dataset():
    src = PromptSource(recs(3), batch_size=3, shuffle=True, seed=1)
    assert src.num_batches_per_epoch == 1
    b = [ids(src.next_batch()) for _ in range(3)]
    assert all(sorted(x) == [0, 1, 2] for x in b) and src.epoch == 3


def test_shuffle_is_a_permutation_per_epoch_and_differs_between_epochs():
    n, bs = 12, 4
    src = PromptSource(recs(n), batch_size=bs, shuffle=True, seed=7)
    epochs = [sum((ids(src.next_batch()) for _ in range(n // bs)), []) for _ in range(4)]
    for order in epochs:
        assert sorted(order) == list(range(n))
    assert len({tuple(o) for o in epochs}) == 4  # 12! orders: a repeat would mean the epoch is not in the seed
    assert epochs[0] != list(range(n))


def test_shuffle_deterministic_and_seed_dependent():
    def draw(seed):
        src = PromptSource(recs(10), batch_size=3, shuffle=True, seed=seed)
        return [ids(src.next_batch()) for _ in range(8)]

    assert draw(3) == draw(3)
    assert draw(3) != draw(4)
    assert draw(-1) == draw(-1) and draw(-1) != draw(1)


def test_shuffled_straddling_batch_takes_tail_then_head():
    src = PromptSource(recs(7), batch_size=3, shuffle=True, seed=0)
    e0, e1 = list(src.epoch_order(0)), list(src.epoch_order(1))
    flat = sum((ids(src.next_batch()) for _ in range(7)), [])  # 21 prompts = 3 epochs
    assert flat[:7] == e0 and flat[7:14] == e1
    assert sorted(flat[14:]) == list(range(7))


@pytest.mark.parametrize("shuffle", [False, True])
def test_exact_resume(shuffle):
    n_batches = 10
    straight = PromptSource(recs(7), batch_size=3, shuffle=shuffle, seed=11)
    want = [ids(straight.next_batch()) for _ in range(n_batches)]

    first = PromptSource(recs(7), batch_size=3, shuffle=shuffle, seed=11)
    got = [ids(first.next_batch()) for _ in range(n_batches // 2)]
    state = json.loads(json.dumps(first.state_dict()))  # checkpoints store it as JSON
    assert state["num_records"] == 7
    resumed = PromptSource(recs(7), batch_size=3, shuffle=shuffle, seed=11)
    resumed.load_state_dict(state)
    assert (resumed.epoch, resumed.offset) == (first.epoch, first.offset)
    got += [ids(resumed.next_batch()) for _ in range(n_batches - n_batches // 2)]
    assert got == want
    assert resumed.state_dict() == straight.state_dict()


def test_resume_with_different_dataset_size_fails():
    src = PromptSource(recs(7), batch_size=3, shuffle=True, seed=0)
    src.next_batch()
    other = PromptSource(recs(8), batch_size=3, shuffle=True, seed=0)
    with pytest.raises(DataError, match="saved with 7 prompts but --prompt-data now has 8"):
        other.load_state_dict(src.state_dict())
