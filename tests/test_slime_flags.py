"""slime / Megatron flags on `lichen train`: every flag classified in one run (one test per class), the checked
comparison with config.json, Megatron torch_dist checkpoints, help texts, and the documented differences."""

from __future__ import annotations

import json

import pytest
import yaml

import lichen.cli
from lichen.config import build_train_parser, parse_train_args, slime_compat
from lichen.config.slime.flags import (
    CHECKED,
    CLASSES,
    DEFAULT_DIFFERS,
    DIFFERS,
    DIFFERS_CLASS,
    MAPPED,
    NA_NO_EFFECT,
    NA_SHARDING,
    NOT_YET,
    REMOVED,
    SAME,
    SLIME_FLAGS,
    UNKNOWN,
    VALUE_DIFFERS,
)
from lichen.errors import ConfigError

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 102,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}


@pytest.fixture
def base(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(TINY))
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
        "100",
    ]


def parse(argv):
    tables: list[str] = []
    args = parse_train_args(argv, show_table=tables.append)
    return args, tables


def rows_of(args):
    return {r.flag: r for r in args._slime_rows}


def failure(argv) -> tuple[str, list[str]]:
    tables: list[str] = []
    with pytest.raises(ConfigError) as info:
        parse_train_args(argv, show_table=tables.append)
    return str(info.value), tables


def test_every_class_is_used_by_the_table():
    used = {rule.cls for rule in SLIME_FLAGS.values()}
    assert used | {SAME, DIFFERS_CLASS, REMOVED, UNKNOWN} == set(CLASSES)


def test_same_class_keeps_lichens_flag(base):
    args, tables = parse(base + ["--lr", "2e-6", "--tensor-model-parallel-size", "2"])
    assert args.lr == 2e-6 and rows_of(args)["--lr"].cls == SAME
    assert len(tables) == 1 and "same | --lr 2e-6" in tables[0]


def test_mapped_flags_are_translated(base):
    args, _ = parse(
        base
        + [
            "--recompute-granularity",
            "full",
            "--lr-warmup-fraction",
            "0.05",
            "--optimizer",
            "adam",
            "--wandb-exp-name",
            "run7",
            "--train-backend",
            "fsdp",
            "--balance-data",
            "--attn-implementation",
            "flash_attention_2",
        ]
    )
    rows = rows_of(args)
    assert args.gradient_checkpointing is True
    assert args.lr_warmup_fraction == 0.05  # lichen's own flag now (slime's name), resolved with the run length
    from lichen.config.train_config import OptimizerConfig

    assert OptimizerConfig.from_args(args).warmup_iters == 5  # 5% of 100 rollout steps x 1 optimizer step each
    args.num_rollout = 40  # e.g. --num-epoch resolved against the data set before the trainer is built
    assert OptimizerConfig.from_args(args).warmup_iters == 2
    assert args.wandb_run_name == "run7"
    assert args.train_backend == "torch"  # slime's FSDP backend is lichen's torch backend
    assert {
        rows[f].cls
        for f in (
            "--recompute-granularity",
            "--optimizer",
            "--wandb-exp-name",
            "--train-backend",
            "--balance-data",
            "--attn-implementation",
        )
    } == {MAPPED}


def test_mapped_flag_with_a_value_lichen_cannot_run_stops(base):
    message, tables = failure(base + ["--optimizer", "sgd", "--hidden-dropout", "0.1"])
    assert "--optimizer sgd" in message and "dropout 0.1" in message
    assert NOT_YET in tables[0]


def test_update_weights_interval_is_lichens_own_flag(base):
    """slime's --update-weights-interval is lichen's own flag (the async loop's): it keeps its value, any N >= 1
    runs with --async, and without it lichen's own check stops the run, not the slime table's "not yet"."""
    assert "--update-weights-interval" in build_train_parser()._option_string_actions
    async_run = ["--num-layers", "2", "--async", "--rollout-num-engines", "1"]
    args, _ = parse(base + ["--update-weights-interval", "2", *async_run])
    row = rows_of(args)["--update-weights-interval"]
    assert (row.cls, row.values, args.update_weights_interval) == (SAME, ["2"], 2)
    message, tables = failure(base + ["--update-weights-interval", "2", "--num-layers", "2"])
    assert "--update-weights-interval 2 needs --async or --fully-async" in message
    assert "same | --update-weights-interval 2 |" in tables[0] and NOT_YET not in tables[0]


def test_checked_shape_mismatch_stops_naming_both_values(base):
    message, tables = failure(base + ["--num-layers", "3", "--hidden-size", "64"])
    assert "--num-layers 3 but hf/config.json num_hidden_layers = 2" in message
    assert "matches hf/config.json hidden_size = 64" in tables[0]


def test_checked_non_shape_mismatch_only_warns(base):
    args, tables = parse(base + ["--num-layers", "2", "--rotary-base", "1000000", "--num-query-groups", "2"])
    rows = rows_of(args)
    assert rows["--rotary-base"].cls == CHECKED and rows["--rotary-base"].note.startswith("warning:")
    assert "rope_theta = 10000.0" in rows["--rotary-base"].note
    assert not any(r.stops for r in args._slime_rows)


def test_checked_model_type_outside_lichens_code_runs_on_the_hf_path(base, tmp_path):
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**TINY, "model_type": "gpt_oss"}))
    args, tables = parse(base + ["--num-layers", "2"])
    row = rows_of(args)["model_type"]
    assert row.cls == MAPPED and row.values == ["gpt_oss"] and "--model-impl hf" in row.lichen
    assert not any(r.stops for r in args._slime_rows)


def test_checked_model_type_nothing_can_load_stops(base, tmp_path):
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**TINY, "model_type": "frobnicate"}))
    message, tables = failure(base + ["--num-layers", "2"])
    assert "has no causal-LM class for model_type 'frobnicate'" in message
    assert f"{NOT_YET} | model_type frobnicate" in tables[0]


def test_not_applicable_sharding_and_no_effect_are_accepted(base):
    args, tables = parse(
        base
        + [
            "--tensor-model-parallel-size",
            "8",
            "--pipeline-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--no-rope-fusion",
            "--use-mcore-models",
            "--attention-dropout",
            "0.0",
        ]
    )
    rows = rows_of(args)
    assert rows["--tensor-model-parallel-size"].cls == NA_SHARDING
    assert rows["--no-rope-fusion"].cls == NA_NO_EFFECT and rows["--attention-dropout"].cls == NA_NO_EFFECT
    assert "FSDP2" in rows["--sequence-parallel"].lichen


def test_dropout_other_than_zero_is_not_available(base):
    message, _ = failure(base + ["--hidden-dropout", "0.1"])
    assert "dropout 0.1" in message


def test_not_available_yet_and_removed_and_unknown_are_all_named_in_one_run(base):
    message, tables = failure(
        base
        + [
            "--enable-mtp-training",
            "--megatron-to-hf-mode",
            "bridge",
            "--train-memory-margin-bytes",
            "5",
            "--frobnicate",
            "3",
            "--num-layers",
            "2",
            "--rollout-batch-size",
            "0",
        ]
    )
    for needle in (
        "4 flags stop this run",
        "--enable-mtp-training",
        "--megatron-to-hf-mode was removed",
        "--train-memory-margin-bytes was removed",
        "unrecognized argument --frobnicate",
        "also: --rollout-batch-size 0",
    ):  # and the first rule the remaining flags break
        assert needle in message, needle
    table = tables[0]
    assert f"{NOT_YET} | --enable-mtp-training" in table and f"{REMOVED} | --megatron-to-hf-mode bridge" in table
    assert f"{UNKNOWN} | --frobnicate 3" in table


def test_megatron_names_get_no_misleading_hint(base):
    # argparse's fuzzy match once suggested --num-threads for --num-layers and --num-rollout for --hidden-dropout
    args, tables = parse(base + ["--num-layers", "2", "--hidden-dropout", "0.0", "--optimizer", "adam"])
    assert "did you mean" not in tables[0]


@pytest.mark.parametrize(
    "flag",
    [
        "--no-load-optim",
        "--moe-input-jitter-eps",
        "--train-iters",
        "--router-ip",
        "--lr-warmup-init",
        "--use-cpu-initialization",
    ],
)
def test_megatron_names_outside_the_table_get_no_unrelated_hint(base, flag):
    # difflib's default 0.6 once paired these with --no-offload-train, --kl-loss-coef, --train-env-vars, ...
    message, tables = failure(base + ["--use-mcore-models", flag, "1"])
    assert f"unrecognized argument {flag}; see lichen train --help" in message


def test_yaml_key_outside_the_table_gets_no_unrelated_hint(base, tmp_path):
    (tmp_path / "c.yaml").write_text("no-load-optim: true\n")
    message, _ = failure(base + ["--config", "c.yaml"])
    assert "unknown flag --no-load-optim; see lichen train --help" in message


def test_more_megatron_switches_are_classified(base):
    args, tables = parse(
        base
        + [
            "--use-flash-attn",
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--make-vocab-size-divisible-by",
            "128",
            "--distributed-timeout-minutes",
            "10",
        ]
    )
    assert {r.cls for r in args._slime_rows if r.flag.startswith(("--use-f", "--tok", "--make", "--dist"))} == {
        NA_NO_EFFECT
    }
    message, _ = failure(base + ["--fp16"])
    assert "--fp16: fp16 training (loss scaling) is not built" in message


def test_lichen_typo_keeps_its_hint(base):
    message, tables = failure(base + ["--rollout-batch-sise", "4"])
    assert "unrecognized argument --rollout-batch-sise; did you mean --rollout-batch-size?" in message
    assert tables == []  # no slime flags: no table


def test_dry_run_prints_the_table_on_stderr_and_yaml_on_stdout(base, capsys):
    rc = lichen.cli.main(["train", *base, "--dry-run", "--num-layers", "2", "--context-parallel-size", "2"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert "checked | --num-layers 2" in err and "counts: " in err
    assert yaml.safe_load(out)["rollout_batch_size"] == 4


def test_blocking_flags_exit_2_after_the_table(base, capsys):
    rc = lichen.cli.main(["train", *base, "--dry-run", "--num-layers", "9"])
    _, err = capsys.readouterr()
    assert rc == 2
    assert err.index("slime/Megatron flags") < err.index("lichen train: error: --num-layers 9")


def test_secret_values_are_redacted_in_the_table(base):
    args, tables = parse(base + ["--wandb-key", "s3cr3t-key-value", "--num-layers", "2"])
    assert "s3cr3t-key-value" not in tables[0] and "--wandb-key <redacted>" in tables[0]


def _torch_dist(path):
    (path / "iter_0000010").mkdir(parents=True)
    (path / "latest_checkpointed_iteration.txt").write_text("10")
    (path / "iter_0000010" / ".metadata").write_bytes(b"")
    (path / "iter_0000010" / "__0_0.distcp").write_bytes(b"")


@pytest.mark.parametrize("flag", ["--ref-load", "--load"])
def test_megatron_torch_dist_checkpoint_is_named(base, tmp_path, flag):
    _torch_dist(tmp_path / "ckpt_torch_dist")
    with pytest.raises(ConfigError) as info:
        parse_train_args(base + [flag, "ckpt_torch_dist"])
    assert f"{flag} 'ckpt_torch_dist': a Megatron torch_dist checkpoint" in str(info.value)
    assert "convert_torch_dist_to_hf" in str(info.value)


def test_lichen_checkpoint_dir_and_hf_ref_load_are_accepted(base, tmp_path):
    step = tmp_path / "run" / "iter_0000002"
    (step / "hf").mkdir(parents=True)
    (step / "meta.json").write_text("{}")
    (tmp_path / "run" / "latest_checkpointed_iteration.txt").write_text("2")
    args = parse_train_args(base + ["--load", "run", "--ref-load", "hf"])
    assert args.load == "run" and args.ref_load == "hf"


def test_help_texts_tell_the_truth():
    helps = {a.option_strings[0]: a.help for a in build_train_parser()._actions if a.option_strings}
    # FSDP2 exists now (--runtime ray shards the trainer ranks): the help no longer calls it unbuilt
    assert "not built yet" not in helps["--train-backend"] and "FSDP2" in helps["--train-backend"]
    assert "--runtime ray" in helps["--train-backend"] and "fsdp" in helps["--train-backend"]
    assert "needs --update-weight-transport disk" not in helps["--rollout-num-engines"]
    assert "float32" in helps["--bf16"] and "lichen's own engines" in helps["--bf16"]


def test_differences_from_slime_are_their_own_class(base):
    """A flag of slime's name with another default or meaning is class "differs" with its note, never "same"
    (each difference is pinned in tests/test_slime_differences.py)."""
    lichen_flags = {f for a in build_train_parser()._actions for f in a.option_strings}
    assert set(DIFFERS) | set(VALUE_DIFFERS) | set(DEFAULT_DIFFERS) <= lichen_flags
    args, tables = parse(base + ["--rm-type", "gpqa", "--colocate", "--use-mcore-models"])
    rows = rows_of(args)
    assert rows["--colocate"].cls == DIFFERS_CLASS and rows["--colocate"].note == DIFFERS["--colocate"]
    assert "differs | --colocate |" in tables[0]
    assert rows["--weight-decay"].note == DEFAULT_DIFFERS["--weight-decay"]  # left out: lichen's default differs
    assert "differs | --weight-decay | lichen's default | not given" in tables[0]
    assert rows["--rm-type"].cls == DIFFERS_CLASS and rows["--rm-type"].note == VALUE_DIFFERS["--rm-type"]["gpqa"]
    assert rows["--rollout-batch-size"].cls == SAME and rows["--rollout-batch-size"].note == ""


def test_counts_follow_the_class_order():
    rows = [
        slime_compat.Row("--a", [], CHECKED, "", ""),
        slime_compat.Row("--b", [], SAME, "", ""),
        slime_compat.Row("--c", [], CHECKED, "", ""),
    ]
    assert slime_compat.counts(rows) == {SAME: 1, CHECKED: 2}


def test_wandb_group_reaches_wandb(base, tmp_path, monkeypatch):
    """--wandb-group keeps slime's name and meaning: the W&B run group."""
    import sys
    import types

    from lichen.config.engine_config import ObserveConfig
    from lichen.observe.metrics import MetricsLogger

    calls: list[dict] = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(kw) or types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    args = parse_train_args(
        base + ["--use-wandb", "--wandb-mode", "offline", "--wandb-group", "grp", "--output-dir", str(tmp_path / "run")]
    )
    MetricsLogger.from_config(ObserveConfig.from_args(args)).close()
    assert calls[0]["group"] == "grp"


def test_yaml_key_of_a_megatron_flag_gets_no_fuzzy_hint(base, tmp_path):
    (tmp_path / "c.yaml").write_text("num-layers: 2\n")
    message, _ = failure(base + ["--config", "c.yaml"])
    assert "c.yaml:1: key 'num-layers': --num-layers is a slime/Megatron flag (checked" in message
    assert "did you mean" not in message
