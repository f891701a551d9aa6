"""The `lichen` entry point: help, version, unknown commands, commands not built yet."""

from lichen.cli import main


def test_help_lists_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "train" in out and "make-tiny-model" in out


def test_unknown_command_exits_2(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_serve_bad_model_is_one_clear_error(capsys):
    assert main(["serve", "--model", "/nonexistent/model"]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and "Traceback" not in err


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("lichen ")


def test_bad_data_file_is_one_clear_error(tiny_ckpt, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "label": "2"}\n{"prompt": "2+2=", "label": \n')
    nokey = tmp_path / "nokey.jsonl"
    nokey.write_text('{"question": "1+1=", "label": "2"}\n' * 4)
    for path, needle in ((bad, "bad.jsonl:2"), (nokey, "prompt")):
        argv = [
            "train",
            "--hf-checkpoint",
            tiny_ckpt,
            "--prompt-data",
            str(path),
            "--rm-type",
            "exact",
            "--rollout-batch-size",
            "1",
            "--n-samples-per-prompt",
            "2",
            "--num-rollout",
            "1",
            "--output-dir",
            str(tmp_path / "out"),
            "--no-progress",
        ]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
