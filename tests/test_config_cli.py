"""`lichen train` end to end: argparse errors, removed flags, --sglang-* pass-through, explicit flags, --help,
--dry-run, --train-env-vars, and the hand-off to lichen.loop.run."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import yaml

import lichen.cli
from lichen.config import build_train_parser, parse_train_args, removed
from lichen.config.rollout import SGLANG_CONSUMED_FLAGS, collect_sglang_passthrough
from lichen.errors import ConfigError, NotAvailableYet


@pytest.fixture
def base(tmp_path, monkeypatch):
    """A valid argv (fake HF dir with config.json, one-line prompt file); cwd is tmp_path."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    return [
        "--hf-checkpoint",
        "hf",
        "--prompt-data",
        "prompts.jsonl",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "2",
        "--rm-type",
        "math",
        "--num-rollout",
        "2",
    ]


def run_cli(argv, capsys):
    rc = lichen.cli.main(["train", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize(
    "extra, needle",
    [
        (
            ["--rollout-batch-sise", "3"],
            "unrecognized argument --rollout-batch-sise; did you mean --rollout-batch-size?",
        ),
        (["--rollout-batch-size", "x"], "argument --rollout-batch-size: invalid int value: 'x'"),
        (["--runtime", "cloud"], "argument --runtime: invalid choice: 'cloud'"),
        (["--lr"], "argument --lr: expected one argument"),
        (["stray"], "unrecognized argument 'stray'"),
        (
            ["--train-memory-margin-bytes", "5"],
            "--train-memory-margin-bytes was removed: the memory saver's own "
            "default margin is used now; drop this flag",
        ),
        (["--runtime", "ray"], "--runtime ray: give --rollout-num-gpus R"),
    ],
)
def test_cli_error_is_one_line_exit_2(base, capsys, extra, needle):
    rc, out, err = run_cli(base + extra, capsys)
    assert rc == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("lichen train: error: ")
    assert needle in err
    assert "Traceback" not in err and "usage:" not in err


def test_unknown_flag_raises_config_error_not_system_exit(base):
    with pytest.raises(ConfigError, match="unrecognized argument --no-such-flag; see lichen train --help"):
        parse_train_args(base + ["--no-such-flag"])


def test_abbreviations_are_not_accepted(base):
    with pytest.raises(ConfigError, match="unrecognized argument --rollout-batch"):
        parse_train_args(base + ["--rollout-batch", "3"])


@pytest.mark.parametrize("form", [["--train-memory-margin-bytes", "1024"], ["--train-memory-margin-bytes=1024"]])
def test_removed_flag_checked_before_argparse(base, form):
    # even with another unknown flag and a bad value around, the removed flag's own message wins
    with pytest.raises(ConfigError) as info:
        parse_train_args(["--bogus", *form, "--rollout-batch-size", "x"])
    assert str(info.value) == (
        "--train-memory-margin-bytes was removed: the memory saver's own default margin is used now; drop this flag"
    )


def test_removed_table_is_data(base, monkeypatch):
    monkeypatch.setitem(removed.REMOVED_FLAGS, "--old-knob", "was removed: use --new-knob instead")
    with pytest.raises(ConfigError, match="^--old-knob was removed: use --new-knob instead$"):
        parse_train_args(base + ["--old-knob=3"])


def test_help_exits_zero_and_lists_consumed_sglang_flags(capsys):
    with pytest.raises(SystemExit) as info:
        parse_train_args(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: lichen train")
    for flag in SGLANG_CONSUMED_FLAGS + ("--rollout-batch-size", "--update-weight-mode", "--eval-prompt-data"):
        assert flag in out
    assert ", ".join(SGLANG_CONSUMED_FLAGS) in " ".join(out.split())
    assert "--train-memory-margin-bytes" in out  # the removed-flags list


def test_help_through_the_cli_wins_over_other_errors(capsys):
    with pytest.raises(SystemExit) as info:
        lichen.cli.main(["train", "--runtime", "ray", "--bogus", "-h"])
    assert info.value.code == 0
    assert "usage: lichen train" in capsys.readouterr().out


def test_parser_contract():
    parser = build_train_parser()
    assert parser.prog == "lichen train"
    with pytest.raises(ConfigError):  # error() raises instead of printing usage and exiting
        parser.parse_args(["--seed", "abc"])


def test_sglang_passthrough_collected_verbatim():
    known = ["--rollout-batch-size", "--seed"]
    extras = [
        "--sglang-mem-fraction-static",
        "0.8",
        "--sglang-enable-metrics",
        "--sglang-tp=2",
        "--sglang-stop",
        "a",
        "-1",
    ]
    assert collect_sglang_passthrough(extras, known) == extras
    with pytest.raises(ConfigError, match="did you mean --seed"):
        collect_sglang_passthrough(["--sglang-x", "1", "--sed", "3"], known)
    with pytest.raises(ConfigError, match="no positional arguments"):
        collect_sglang_passthrough(["value", "--sglang-x"], known)


def test_sglang_passthrough_through_the_parser_is_not_available_yet(base):
    with pytest.raises(NotAvailableYet) as info:
        parse_train_args(base + ["--sglang-mem-fraction-static", "0.8", "--seed", "7", "--sglang-enable-metrics"])
    assert str(info.value).startswith("--sglang-mem-fraction-static: --sglang-... flags apply to SGLang servers")


def test_consumed_sglang_flag_is_parsed_by_lichen(base):
    args = parse_train_args(base + ["--sglang-server-concurrency", "8"])
    assert args.sglang_server_concurrency == 8 and args.sglang_passthrough == []


def test_explicit_flags_recorded(base):
    args = parse_train_args(base + ["--seed", "1234", "--no-offload-train", "--bf16", "--eps-clip=0.2"])
    # given with their default value still counts as given; defaults and derived values do not
    assert {"seed", "offload_train", "bf16", "eps_clip", "rollout_batch_size", "hf_checkpoint"} <= args._explicit
    assert not {"lr", "eps_clip_high", "global_batch_size", "offload_rollout", "output_dir"} & args._explicit


def test_dry_run_prints_resolved_yaml(base, capsys, monkeypatch):
    monkeypatch.setenv("LICHEN_TEST_ENV", "")  # recorded as absent before: the run's setting is undone after the test
    monkeypatch.delenv("LICHEN_TEST_ENV")
    monkeypatch.setitem(sys.modules, "lichen.loop", None)  # importing the loop would fail: dry run must not
    rc, out, err = run_cli(
        base
        + ["--dry-run", "--train-env-vars", '{"LICHEN_TEST_ENV": "on"}', "--eval-prompt-data", "ev", "prompts.jsonl"],
        capsys,
    )
    assert (rc, err) == (0, "")
    config = yaml.safe_load(out)
    assert config["rollout_batch_size"] == 4 and config["global_batch_size"] == 8
    assert config["train_env_vars"] == {"LICHEN_TEST_ENV": "on"}
    assert config["eval_datasets"] == [["ev", "prompts.jsonl"]]
    assert config["dry_run"] is True
    assert not [k for k in config if k.startswith("_")]
    assert list(config) == sorted(config)
    assert [line.split(":")[0] for line in out.splitlines() if not line.startswith((" ", "-"))] == sorted(config)
    assert os.environ["LICHEN_TEST_ENV"] == "on"


def test_without_dry_run_the_loop_runs(base, monkeypatch):
    calls = []
    fake = types.ModuleType("lichen.loop")
    fake.run = calls.append
    monkeypatch.setitem(sys.modules, "lichen.loop", fake)
    monkeypatch.setenv("LICHEN_TEST_ENV2", "")  # recorded as absent before: the run's setting is undone after the test
    monkeypatch.delenv("LICHEN_TEST_ENV2")
    from lichen.train_cli import main

    assert main(base + ["--train-env-vars", '{"LICHEN_TEST_ENV2": "1"}']) == 0
    assert len(calls) == 1 and calls[0].rollout_batch_size == 4 and calls[0].dry_run is False
    assert os.environ["LICHEN_TEST_ENV2"] == "1"


def test_dry_run_imports_no_torch(base, tmp_path):
    # A fresh interpreter: lichen.config and the dry run must not pull in torch (slow) or the loop.
    code = (
        "import sys; from lichen.train_cli import main; rc = main(sys.argv[1:]); "
        "bad = [m for m in ('torch', 'lichen.loop', 'transformers') if m in sys.modules]; "
        "assert rc == 0 and not bad, bad"
    )
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(lichen.cli.__file__))}
    result = subprocess.run(
        [sys.executable, "-c", code, *base, "--dry-run"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "rollout_batch_size: 4" in result.stdout


# ---- values that used to pass the flag checks and fail later with a traceback: one line, exit 2 -------------
@pytest.fixture
def sized(base, tmp_path):
    """`base` with a config.json that has a vocabulary and positions (the checks read both)."""
    (tmp_path / "hf" / "config.json").write_text('{"vocab_size": 100, "max_position_embeddings": 64}')
    return base


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--lr", "inf"], "--lr inf: must be a finite number in [0, inf)"),
        (["--adam-eps=-inf"], "--adam-eps -inf: must be a finite number"),
        (["--seed", str(2**64)], f"--seed {2**64}: must be in [0, 4294967295]"),
        (["--seed", "-1"], "--seed -1: must be in [0, 4294967295]"),
        (
            ["--rollout-stop-token-ids", "7", "100"],
            "--rollout-stop-token-ids: 100 is not a token id of the model (must be in [0, 100))",
        ),
        (["--rollout-max-context-len", "64"], "--rollout-max-context-len 64: the model (hf) has 64 positions"),
        (["--device", "cuda"], "--device cuda: "),
    ],
)
def test_late_failures_are_caught_by_the_flag_checks(sized, capsys, monkeypatch, extra, needle):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on a machine with a GPU
    rc, out, err = run_cli(sized + extra, capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert needle in err, err


def test_accepted_edges_of_the_new_checks(sized):
    args = parse_train_args(sized + ["--seed", str(2**32 - 1), "--rollout-stop-token-ids", "0", "99", "--lr", "1e3"])
    assert args.seed == 2**32 - 1 and args.rollout_stop_token_ids == [0, 99] and args.rollout_max_context_len == 63


@pytest.mark.parametrize(
    "extra, env, needle",
    [
        (["--context-length", "65"], None, "--context-length 65 is above the 64 positions of the model"),
        (["--health-check-timeout", "-1"], None, "--health-check-timeout -1.0: must be a positive number of seconds"),
        (["--health-check-timeout", "inf"], None, "--health-check-timeout inf: must be a positive number"),
        ([], "soon", "$SGLANG_HEALTH_CHECK_TIMEOUT soon: must be a positive number"),
    ],
)
def test_serve_limits_are_one_line_exit_2(sized, capsys, monkeypatch, extra, env, needle):
    if env is not None:
        monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", env)
    rc = lichen.cli.main(["serve", "--model", "hf", "--port", "0", *extra])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert needle in err, err


def _train_on(tiny_ckpt, data, tmp_path, *extra) -> list[str]:
    return [
        "--hf-checkpoint",
        tiny_ckpt,
        "--prompt-data",
        str(data),
        "--rm-type",
        "math",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "2",
        "--rollout-max-response-len",
        "2",
        "--num-rollout",
        "1",
        "--debug-rollout-only",
        "--output-dir",
        str(tmp_path / "out"),
        "--no-progress",
        *extra,
    ]


def test_bad_data_rows_stop_the_run_before_it_starts(tiny_ckpt, tmp_path, capsys):
    import json

    data = tmp_path / "d.jsonl"
    rows = [json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}).encode() for i in range(200)]
    rows[49] = b'{"prompt": "", "label": "x"}'
    data.write_bytes(b"\n".join(rows) + b"\n")
    rc, out, err = run_cli(_train_on(tiny_ckpt, data, tmp_path), capsys)
    assert rc == 2 and "Traceback" not in err and err.count("\n") == 1
    assert f"{data}:50: the prompt under key 'prompt' is an empty string" in err and "--skip-bad-rows" in err
    rows[49], rows[9] = rows[49], b'{"prompt": "caf\xe9", "label": "x"}'  # Latin-1: not UTF-8
    data.write_bytes(b"\n".join(rows) + b"\n")
    rc, out, err = run_cli(_train_on(tiny_ckpt, data, tmp_path), capsys)
    assert rc == 2 and "Traceback" not in err and f"{data}:10: not UTF-8 text" in err
    rc, out, err = run_cli(_train_on(tiny_ckpt, data, tmp_path, "--skip-bad-rows"), capsys)
    assert rc == 0 and "skipped 2 bad row(s) of 200 (--skip-bad-rows)" in err
