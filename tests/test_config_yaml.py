"""`lichen train --config FILE.yaml`: spellings, typing as on the command line, CLI precedence, and errors that
name the file, line and key."""

from __future__ import annotations

import pytest

import lichen.cli
from lichen.config import parse_train_args
from lichen.config.yaml_config import find_config_path
from lichen.errors import ConfigError, NotAvailableYet


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    return tmp_path


GOOD = """\
hf-checkpoint: hf
prompt_data: prompts.jsonl
rollout-batch-size: 8
n_samples_per_prompt: 4
rm-type: math
num-rollout: 3
lr: 1e-5
rollout-top-k: -1
rollout-temperature: 0.7
rollout-stop-token-ids: [7, 9]
eval-prompt-data: {gsm: prompts.jsonl, small: "prompts.jsonl@[:1]"}
bf16: true
apply_chat_template: false
colocate: true
offload-rollout: false
train-env-vars: {OMP_NUM_THREADS: "2"}
tool-key: null
"""


def write(env, text: str, name: str = "run.yaml") -> str:
    (env / name).write_text(text)
    return name


def test_yaml_values_typed_as_on_the_command_line(env):
    args = parse_train_args(["--config", write(env, GOOD)])
    assert (args.rollout_batch_size, args.n_samples_per_prompt, args.num_rollout) == (8, 4, 3)
    assert args.lr == 1e-5 and isinstance(args.lr, float)  # YAML reads 1e-5 as text; --lr's type makes it float
    assert (args.rollout_top_k, args.rollout_temperature, args.rollout_stop_token_ids) == (-1, 0.7, [7, 9])
    assert args.eval_datasets == [("gsm", "prompts.jsonl"), ("small", "prompts.jsonl@[:1]")]
    assert (args.bf16, args.apply_chat_template) == (True, False)
    assert (args.colocate, args.offload_train, args.offload_rollout) == (True, True, False)
    assert args.train_env_vars == {"OMP_NUM_THREADS": "2"}
    assert args.tool_key is None and "tool_key" not in args._explicit  # null = not given
    assert {"rollout_batch_size", "lr", "offload_rollout", "apply_chat_template", "config"} <= args._explicit
    assert args.global_batch_size == 32


def test_command_line_wins(env):
    path = write(env, GOOD)
    args = parse_train_args(
        [
            "--rollout-batch-size",
            "2",
            f"--config={path}",
            "--lr",
            "3e-4",
            "--rollout-stop-token-ids",
            "1",
            "--offload-rollout",
        ]
    )
    assert (args.rollout_batch_size, args.lr, args.rollout_stop_token_ids) == (2, 3e-4, [1])
    assert args.offload_rollout is True
    assert args.n_samples_per_prompt == 4  # still from the file


def test_negative_key_of_a_boolean_pair(env):
    text = GOOD.replace("offload-rollout: false", "no-offload-rollout: true")
    assert parse_train_args(["--config", write(env, text)]).offload_rollout is False


def test_list_and_scalar_for_multi_value_flags(env):
    text = GOOD.replace("rollout-stop-token-ids: [7, 9]", "rollout-stop-token-ids: 5").replace(
        'eval-prompt-data: {gsm: prompts.jsonl, small: "prompts.jsonl@[:1]"}', "eval-prompt-data: [a, prompts.jsonl]"
    )
    args = parse_train_args(["--config", write(env, text)])
    assert args.rollout_stop_token_ids == [5] and args.eval_datasets == [("a", "prompts.jsonl")]


def test_empty_file_is_no_flags(env):
    path = write(env, "# nothing\n")
    with pytest.raises(ConfigError, match="--hf-checkpoint is required"):
        parse_train_args(["--config", path])


def test_config_values_still_validated(env):
    path = write(env, GOOD.replace("rollout-temperature: 0.7", "rollout-temperature: 0"))
    with pytest.raises(ConfigError, match=r"--rollout-temperature 0\.0: must be a finite number in \(0, inf\)"):
        parse_train_args(["--config", path])


def test_sglang_keys_pass_through(env):
    path = write(env, GOOD + "sglang-mem-fraction-static: 0.8\n")
    with pytest.raises(NotAvailableYet, match="^--sglang-mem-fraction-static: --sglang-... flags apply"):
        parse_train_args(["--config", path])


@pytest.mark.parametrize(
    "text, needle",
    [
        (
            "rollout-batch-size: 8\nrollout-batch-sise: 3\n",
            "run.yaml:2: key 'rollout-batch-sise': unknown flag --rollout-batch-sise; did you mean rollout-batch-size?",
        ),
        ("zzz_qqq: 1\n", "run.yaml:1: key 'zzz_qqq': unknown flag --zzz-qqq; see lichen train --help"),
        (
            "\nrollout-batch-size: many\n",
            "run.yaml:2: key 'rollout-batch-size': argument --rollout-batch-size: invalid int value: 'many'",
        ),
        ("runtime: cloud\n", "run.yaml:1: key 'runtime': argument --runtime: invalid choice: 'cloud'"),
        ("bf16: 1\n", "run.yaml:1: key 'bf16': expected true or false, got 1"),
        ('offload-train: "yes please"\n', "run.yaml:1: key 'offload-train': expected true or false"),
        ("rm-type: true\n", "run.yaml:1: key 'rm-type': expected a value, got true"),
        ("lr: [1, 2]\n", "run.yaml:1: key 'lr': expected one value, got a list"),
        ("rollout-stop-token-ids: [[1]]\n", "run.yaml:1: key 'rollout-stop-token-ids': expected one value"),
        (
            "rollout-batch-size: 8\nrollout_batch_size: 8\n",
            "run.yaml:2: key 'rollout_batch_size': --rollout-batch-size is already set on line 1",
        ),
        (
            "train-memory-margin-bytes: 10\n",
            "run.yaml:1: key 'train-memory-margin-bytes': --train-memory-margin-bytes was removed",
        ),
        ("config: other.yaml\n", "run.yaml:1: key 'config': a config file cannot name another"),
        ("help: true\n", "run.yaml:1: key 'help': unknown flag --help"),
        ("- rollout-batch-size\n", "run.yaml:1: the config must be a mapping"),
        ("[a, b]: 1\n", "run.yaml:1: a key must be a flag name"),
        ("rollout-batch-size: 8\nlr: [1\n", "--config 'run.yaml': not valid YAML:"),
        ("a: b: c\n", "line 1"),
    ],
)
def test_bad_config_names_file_line_and_key(env, text, needle):
    path = write(env, text)
    with pytest.raises(ConfigError) as info:
        parse_train_args(["--config", path])
    message = str(info.value)
    assert needle in message, message
    assert "run.yaml" in message and "\n" not in message


def test_missing_config_file(env):
    with pytest.raises(ConfigError, match="--config 'nope.yaml': no such file"):
        parse_train_args(["--config", "nope.yaml"])


def test_bad_config_through_the_cli_is_one_line(env, capsys):
    path = write(env, "rollout-batch-size: [\n")
    assert lichen.cli.main(["train", "--config", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lichen train: error: --config 'run.yaml': not valid YAML") and err.count("\n") == 1


@pytest.mark.parametrize(
    "argv, path",
    [
        (["--seed", "1"], None),
        (["--config", "a.yaml"], "a.yaml"),
        (["--config=a.yaml", "--config", "b.yaml"], "b.yaml"),  # the last one, as argparse would take it
        (["--config"], None),  # argparse reports the missing value
    ],
)
def test_find_config_path(argv, path):
    assert find_config_path(argv) == path
