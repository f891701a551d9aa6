"""`lichen eval`: evaluation alone on the quick-start model, metrics file and table; user errors exit 2."""

from __future__ import annotations

from lichen.cli import main
from lichen.observe.metrics import read_metrics


def test_lichen_eval_runs_alone(tiny_ckpt, addition_data, tmp_path, capsys):
    out = tmp_path / "ev"
    code = main(
        [
            "eval",
            "--hf-checkpoint",
            tiny_ckpt,
            "--eval-prompt-data",
            "add",
            f"{addition_data}@[:4]",
            "--rm-type",
            "leading_number",
            "--n-samples-per-eval-prompt",
            "4",
            "--eval-max-response-len",
            "4",
            "--output-dir",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    table = capsys.readouterr().out
    assert table.startswith("add: reward ") and "pass@1 " in table and "pass@4 " in table
    assert "4 prompts x 4 samples" in table
    (row,) = read_metrics(str(out))
    assert row["step"] == 0 and row["eval/add/num_samples"] == 16
    assert 0.0 <= row["eval/add/pass@1"] <= row["eval/add/pass@2"] <= row["eval/add/pass@4"] <= 1.0


def test_lichen_eval_user_errors(tiny_ckpt, tmp_path, capsys):
    assert main(["eval", "--hf-checkpoint", tiny_ckpt, "--rm-type", "math"]) == 2
    err = capsys.readouterr().err
    assert "--eval-prompt-data" in err and "Traceback" not in err
    assert (
        main(
            [
                "eval",
                "--hf-checkpoint",
                tiny_ckpt,
                "--rm-type",
                "math",
                "--eval-prompt-data",
                "a",
                str(tmp_path / "missing.jsonl"),
            ]
        )
        == 2
    )
    assert "missing.jsonl" in capsys.readouterr().err
