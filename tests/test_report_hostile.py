"""`lichen report` on run directories it did not write itself (issue 33): NaN / Infinity, bytes that are not UTF-8,
a `latest` file that is a FIFO and a link out of the run. The page is written (or one line says why), never a
traceback, and its data parses as strict JSON."""

from __future__ import annotations

import gzip
import json
import os
import re

import pytest

from lichen.cli import main


def page_data(path) -> dict:
    text = open(path, encoding="utf-8").read()
    m = re.search(r'<script id="report-data" type="application/json">(.*?)</script>', text, re.S)
    # what the page's JSON.parse does: no NaN, no Infinity
    return json.loads(m.group(1), parse_constant=lambda c: pytest.fail(f"the page's data holds {c}"))


def test_nan_and_non_utf8_metrics_make_a_page(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(
        b'{"step": 1, "rollout/reward_mean": NaN, "train/loss": Infinity}\n'
        b'{"step": 2, "rollout/reward_mean": 0.5, "train/loss": -Infinity, "note": "caf\xe9"}\n'
        b'{"step": 3, "rollout/reward_mean": 1e999}\n'
    )
    save = tmp_path / "save"
    (save / "iter_0000001").mkdir(parents=True)
    os.mkfifo(save / "latest_checkpointed_iteration.txt")  # would block the report's read forever
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 777_777)
    os.symlink(secret, save / "iter_0000001" / "model.safetensors")  # its size must not show up on the page
    os.symlink(secret, save / "iter_0000001" / "meta.json")
    (run / "config.json").write_text('{"lr": NaN, "save": ' + json.dumps(str(save)) + "}")
    (run / "samples").mkdir()
    with gzip.open(run / "samples" / "step_000001.jsonl.gz", "wb") as f:
        f.write(b'{"step": 1, "reward": NaN, "response": "ok"}\n')
    with gzip.open(run / "samples" / "step_000002.jsonl.gz", "wb") as f:
        f.write(b'{"step": 2, "response": "\xff\xfe"}\n')

    assert main(["report", str(run)]) == 0, capsys.readouterr().err
    data = page_data(run / "report.html")
    assert [m["step"] for m in data["metrics"]] == [1, 2, 3]
    assert data["metrics"][0]["rollout/reward_mean"] is None and data["metrics"][0]["train/loss"] is None
    assert data["metrics"][1]["note"] == "caf\ufffd"  # the bad byte spoils its string only
    assert data["metrics"][2]["rollout/reward_mean"] is None
    assert data["config"]["lr"] is None
    assert [s["step"] for s in data["samples"]] == [1] and data["samples"][0]["reward"] is None
    (ckpt,) = data["checkpoints"]
    assert ckpt["latest"] is False and ckpt["bytes"] < 777_777 and ckpt["weight_version"] is None


def test_a_metrics_line_of_a_huge_integer_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 1' + "0" * 5000 + "}\n{}\n")
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert "metrics.jsonl line 2: unreadable JSON" in err and "\n" not in err
