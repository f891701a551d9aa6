"""Every validation rule of `lichen train` (lichen/config/*): each rejection is a ConfigError naming the flag."""

from __future__ import annotations

import argparse

import pytest

from lichen.config import parse_train_args
from lichen.errors import ConfigError, NotAvailableYet

BASE = {
    "--rollout-batch-size": "4",
    "--n-samples-per-prompt": "2",
    "--rm-type": "math",
    "--num-rollout": "2",
}


@pytest.fixture
def files(tmp_path, monkeypatch):
    """A fake HF checkpoint dir (config.json only) and a one-line prompt file; cwd is tmp_path."""
    monkeypatch.chdir(tmp_path)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    (tmp_path / "eval.jsonl").write_text('{"prompt": "2+2=", "label": "4"}\n')
    (tmp_path / "afile").write_text("x")
    return tmp_path


def make_argv(*extra: str, drop: tuple[str, ...] = ()) -> list[str]:
    """The valid base command line (paths relative to the `files` cwd), minus `drop`, plus `extra`."""
    base = {"--hf-checkpoint": "hf", "--prompt-data": "prompts.jsonl", **BASE}
    argv: list[str] = []
    for flag, value in base.items():
        if flag not in drop:
            argv += [flag, value]
    return argv + list(extra)


def parse(*extra: str, drop: tuple[str, ...] = ()) -> argparse.Namespace:
    return parse_train_args(make_argv(*extra, drop=drop))


PARTIAL_FILTER = "lichen.rollout.filters.check_reward_nonzero_std"

# (id, extra args, dropped base flags, substrings the message must contain, exception class)
REJECTIONS = [
    # general / model
    ("runtime-ray", ["--runtime", "ray"], (), ["--runtime ray", "--rollout-num-gpus R"], ConfigError),
    ("megatron", ["--train-backend", "megatron"], (), ["--train-backend megatron", "Megatron"], NotAvailableYet),
    (
        "megatron-to-hf",
        ["--megatron-to-hf-mode", "raw"],
        (),
        ["--megatron-to-hf-mode was removed", "PR #2249"],
        ConfigError,
    ),
    ("hf-required", [], ("--hf-checkpoint",), ["--hf-checkpoint is required"], ConfigError),
    ("hf-missing", ["--hf-checkpoint", "nope"], (), ["--hf-checkpoint", "'nope'", "no such directory"], ConfigError),
    ("hf-no-config", ["--hf-checkpoint", "."], (), ["--hf-checkpoint", "no config.json"], ConfigError),
    ("ref-load-missing", ["--ref-load", "nope"], (), ["--ref-load", "'nope'"], ConfigError),
    ("num-threads", ["--num-threads", "0"], (), ["--num-threads 0", ">= 1"], ConfigError),
    ("output-dir-file", ["--output-dir", "afile"], (), ["--output-dir", "not a directory"], ConfigError),
    (
        "env-bad-json",
        ["--train-env-vars", "{A: 1"],
        (),
        ["--train-env-vars", "not valid JSON", '{"OMP_NUM_THREADS": "2"}'],
        ConfigError,
    ),
    ("env-not-object", ["--train-env-vars", '["A"]'], (), ["--train-env-vars", "array, not an object"], ConfigError),
    (
        "env-not-string",
        ["--train-env-vars", '{"OMP_NUM_THREADS": 2}'],
        (),
        ["--train-env-vars", "'OMP_NUM_THREADS'", "not a string"],
        ConfigError,
    ),
    # debug
    (
        "save-template",
        ["--save-debug-rollout-data", "d.pt"],
        (),
        ["--save-debug-rollout-data", "{rollout_id}"],
        ConfigError,
    ),
    (
        "load-template",
        ["--load-debug-rollout-data", "d.pt"],
        (),
        ["--load-debug-rollout-data", "{rollout_id}"],
        ConfigError,
    ),
    (
        "rollout-only-train-only",
        ["--debug-rollout-only", "--debug-train-only"],
        (),
        ["--debug-rollout-only", "--debug-train-only"],
        ConfigError,
    ),
    (
        "rollout-only-load",
        ["--debug-rollout-only", "--load-debug-rollout-data", "d{rollout_id}"],
        (),
        ["--debug-rollout-only", "--load-debug-rollout-data"],
        ConfigError,
    ),
    (
        "train-only-no-dumps",
        ["--debug-train-only"],
        (),
        ["--debug-train-only", "--load-debug-rollout-data"],
        ConfigError,
    ),
    # data
    ("prompt-required", [], ("--prompt-data",), ["--prompt-data is required"], ConfigError),
    (
        "prompt-missing",
        ["--prompt-data", "nope.jsonl"],
        (),
        ["--prompt-data", "'nope.jsonl'", "does not exist"],
        ConfigError,
    ),
    (
        "prompt-missing-slice",
        ["--prompt-data", "nope.jsonl@[:10]"],
        (),
        ["--prompt-data 'nope.jsonl@[:10]'", "'nope.jsonl' does not exist"],
        ConfigError,
    ),
    ("prompt-is-dir", ["--prompt-data", "hf"], (), ["--prompt-data", "is a directory"], ConfigError),
    ("max-prompt-len", ["--rollout-max-prompt-len", "0"], (), ["--rollout-max-prompt-len 0"], ConfigError),
    ("input-key-empty", ["--input-key", ""], (), ["--input-key"], ConfigError),
    # rollout
    (
        "post-write-hook-nccl",
        ["--rollout-num-engines", "2", "--custom-update-weight-post-write-path", "m.f"],
        (),
        ["--custom-update-weight-post-write-path", "--update-weight-transport disk"],
        ConfigError,
    ),
    ("router-ip", ["--sglang-router-ip", "1.2.3.4"], (), ["--sglang-router-ip"], NotAvailableYet),
    ("router-port", ["--sglang-router-port", "30000"], (), ["--sglang-router-port"], NotAvailableYet),
    (
        "sglang-passthrough",
        ["--sglang-mem-fraction-static", "0.8"],
        (),
        ["--sglang-mem-fraction-static", "--sglang-... flags apply to SGLang servers that lichen launches"],
        NotAvailableYet,
    ),
    ("rbs-required", [], ("--rollout-batch-size",), ["--rollout-batch-size is required"], ConfigError),
    ("rbs-zero", ["--rollout-batch-size", "0"], (), ["--rollout-batch-size 0", ">= 1"], ConfigError),
    ("n-zero", ["--n-samples-per-prompt", "0"], (), ["--n-samples-per-prompt 0"], ConfigError),
    ("response-len", ["--rollout-max-response-len", "0"], (), ["--rollout-max-response-len 0"], ConfigError),
    ("temperature-zero", ["--rollout-temperature", "0"], (), ["--rollout-temperature 0.0", "(0, inf)"], ConfigError),
    ("temperature-neg", ["--rollout-temperature", "-1"], (), ["--rollout-temperature -1.0"], ConfigError),
    ("temperature-nan", ["--rollout-temperature", "nan"], (), ["--rollout-temperature nan"], ConfigError),
    ("top-p-zero", ["--rollout-top-p", "0"], (), ["--rollout-top-p 0.0", "(0, 1]"], ConfigError),
    ("top-p-big", ["--rollout-top-p", "1.5"], (), ["--rollout-top-p 1.5"], ConfigError),
    ("top-k-zero", ["--rollout-top-k", "0"], (), ["--rollout-top-k 0", "-1"], ConfigError),
    ("top-k-neg", ["--rollout-top-k", "-2"], (), ["--rollout-top-k -2"], ConfigError),
    ("stop-ids", ["--rollout-stop-token-ids", "5", "-3"], (), ["--rollout-stop-token-ids", "-3"], ConfigError),
    ("concurrency", ["--sglang-server-concurrency", "0"], (), ["--sglang-server-concurrency 0"], ConfigError),
    ("max-batch", ["--rollout-max-batch-size", "0"], (), ["--rollout-max-batch-size 0"], ConfigError),
    ("rm-both", ["--custom-rm-path", "os.path.join"], (), ["--rm-type", "--custom-rm-path"], ConfigError),
    ("rm-none", [], ("--rm-type",), ["--rm-type", "--custom-rm-path"], ConfigError),
    (
        "rm-path-module",
        ["--custom-rm-path", "no_such_module_xyz.f"],
        ("--rm-type",),
        ["--custom-rm-path", "no_such_module_xyz"],
        ConfigError,
    ),
    (
        "rollout-fn-not-dotted",
        ["--rollout-function-path", "nodots"],
        (),
        ["--rollout-function-path", "dotted"],
        ConfigError,
    ),
    (
        "generate-fn-not-async",
        ["--custom-generate-function-path", "os.path.join"],
        (),
        ["--custom-generate-function-path", "async"],
        ConfigError,
    ),
    # train
    ("rollout-and-epoch", ["--num-epoch", "1"], (), ["--num-rollout", "--num-epoch", "both"], ConfigError),
    ("no-length", [], ("--num-rollout",), ["--num-rollout", "--num-epoch", "neither"], ConfigError),
    ("num-rollout-zero", ["--num-rollout", "0"], (), ["--num-rollout 0"], ConfigError),
    ("num-epoch-zero", ["--num-epoch", "0"], ("--num-rollout",), ["--num-epoch 0"], ConfigError),
    (
        "epoch-no-data",
        ["--num-epoch", "1", "--load-debug-rollout-data", "d{rollout_id}"],
        ("--num-rollout", "--prompt-data"),
        ["--num-epoch", "--prompt-data"],
        ConfigError,
    ),
    (
        "gbs-steps-disagree",
        ["--global-batch-size", "4", "--num-steps-per-rollout", "3"],
        (),
        ["--global-batch-size 4", "--num-steps-per-rollout 3", "8 samples"],
        ConfigError,
    ),
    ("gbs-not-divisor", ["--global-batch-size", "3"], (), ["--global-batch-size 3", "divisor of 8"], ConfigError),
    (
        "steps-not-divisor",
        ["--num-steps-per-rollout", "3"],
        (),
        ["--num-steps-per-rollout 3", "divisor of 8"],
        ConfigError,
    ),
    ("gbs-zero", ["--global-batch-size", "0"], (), ["--global-batch-size 0"], ConfigError),
    ("steps-zero", ["--num-steps-per-rollout", "0"], (), ["--num-steps-per-rollout 0"], ConfigError),
    (
        "micro-not-divisor",
        ["--micro-batch-size", "3"],
        (),
        ["--micro-batch-size 3", "global batch size 8"],
        ConfigError,
    ),
    ("micro-zero", ["--micro-batch-size", "0"], (), ["--micro-batch-size 0"], ConfigError),
    (
        "dynamic-no-tokens",
        ["--use-dynamic-batch-size"],
        (),
        ["--use-dynamic-batch-size", "--max-tokens-per-gpu"],
        ConfigError,
    ),
    (
        "max-tokens-zero",
        ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "0"],
        (),
        ["--max-tokens-per-gpu 0"],
        ConfigError,
    ),
    ("lr-neg", ["--lr", "-1"], (), ["--lr -1.0"], ConfigError),
    ("min-lr-above", ["--lr", "1e-6", "--min-lr", "1e-5"], (), ["--min-lr", "--lr"], ConfigError),
    ("warmup-neg", ["--lr-warmup-iters", "-1"], (), ["--lr-warmup-iters -1"], ConfigError),
    ("decay-iters-zero", ["--lr-decay-iters", "0"], (), ["--lr-decay-iters 0"], ConfigError),
    ("weight-decay-neg", ["--weight-decay", "-0.1"], (), ["--weight-decay -0.1"], ConfigError),
    ("beta1-one", ["--adam-beta1", "1.0"], (), ["--adam-beta1 1.0", "[0, 1)"], ConfigError),
    ("beta2-neg", ["--adam-beta2", "-0.1"], (), ["--adam-beta2 -0.1"], ConfigError),
    ("adam-eps-zero", ["--adam-eps", "0"], (), ["--adam-eps 0.0"], ConfigError),
    ("clip-grad-neg", ["--clip-grad", "-1"], (), ["--clip-grad -1.0"], ConfigError),
    (
        "custom-loss-no-path",
        ["--loss-type", "custom_loss"],
        (),
        ["--loss-type custom_loss", "--custom-loss-function-path"],
        ConfigError,
    ),
    (
        "loss-path-no-custom",
        ["--custom-loss-function-path", "os.path.join"],
        (),
        ["--custom-loss-function-path", "--loss-type custom_loss"],
        ConfigError,
    ),
    (
        "loss-path-bad",
        ["--loss-type", "custom_loss", "--custom-loss-function-path", "os.path.nope"],
        (),
        ["--custom-loss-function-path", "nope"],
        ConfigError,
    ),
    (
        "rollout-logprobs-and-recompute",
        ["--use-rollout-logprobs", "--force-recompute-old-log-probs"],
        (),
        ["--use-rollout-logprobs", "--force-recompute-old-log-probs"],
        ConfigError,
    ),
    # algo
    ("critic-lr-without-ppo", ["--critic-lr", "1e-4"], (), ["--critic-lr", "ppo"], ConfigError),
    ("critic-only-without-ppo", ["--num-critic-only-steps", "2"], (), ["--num-critic-only-steps", "ppo"], ConfigError),
    ("value-clip-zero", ["--advantage-estimator", "ppo", "--value-clip", "0"], (), ["--value-clip"], ConfigError),
    ("ppo-sft", ["--advantage-estimator", "ppo", "--loss-type", "sft_loss"], (), ["ppo", "sft_loss"], ConfigError),
    ("kl-coef-grpo", ["--kl-coef", "0.1"], (), ["--kl-coef", "grpo"], ConfigError),
    (
        "dual-clip-gspo",
        ["--advantage-estimator", "gspo", "--eps-clip-c", "3"],
        (),
        ["--eps-clip-c", "gspo"],
        ConfigError,
    ),
    (
        "custom-adv-ppo",
        ["--advantage-estimator", "ppo", "--custom-advantage-function-path", "os.path.join"],
        (),
        ["--custom-advantage-function-path", "ppo"],
        ConfigError,
    ),
    (
        "no-norm-rloo",
        ["--advantage-estimator", "rloo", "--disable-rewards-normalization"],
        (),
        ["--disable-rewards-normalization", "rloo"],
        ConfigError,
    ),
    (
        "rpp-no-norm",
        ["--advantage-estimator", "reinforce_plus_plus"],
        (),
        ["--advantage-estimator reinforce_plus_plus", "--normalize-advantages"],
        ConfigError,
    ),
    (
        "rpp-baseline-no-norm",
        ["--advantage-estimator", "reinforce_plus_plus_baseline"],
        (),
        ["reinforce_plus_plus_baseline", "--normalize-advantages"],
        ConfigError,
    ),
    ("eps-clip-zero", ["--eps-clip", "0"], (), ["--eps-clip 0.0"], ConfigError),
    ("eps-clip-high-zero", ["--eps-clip-high", "0"], (), ["--eps-clip-high 0.0"], ConfigError),
    ("eps-clip-c-one", ["--eps-clip-c", "1.0"], (), ["--eps-clip-c 1.0", "(1, inf)"], ConfigError),
    ("opsm-delta-zero", ["--opsm-delta", "0"], (), ["--opsm-delta 0.0"], ConfigError),
    ("entropy-neg", ["--entropy-coef", "-0.1"], (), ["--entropy-coef -0.1"], ConfigError),
    ("kl-loss-coef-neg", ["--use-kl-loss", "--kl-loss-coef", "-0.1"], (), ["--kl-loss-coef -0.1"], ConfigError),
    (
        "kl-coef-neg",
        ["--kl-coef", "-0.1", "--advantage-estimator", "reinforce_plus_plus_baseline", "--normalize-advantages"],
        (),
        ["--kl-coef -0.1"],
        ConfigError,
    ),
    (
        "two-kl",
        ["--use-kl-loss", "--kl-loss-coef", "0.1", "--kl-coef", "0.1"],
        (),
        ["--kl-coef", "--kl-loss-coef"],
        ConfigError,
    ),
    ("kl-loss-no-use", ["--kl-loss-coef", "0.1"], (), ["--kl-loss-coef", "add --use-kl-loss"], ConfigError),
    ("gamma", ["--gamma", "1.5"], (), ["--gamma 1.5", "[0, 1]"], ConfigError),
    ("lambd", ["--lambd", "-0.1"], (), ["--lambd -0.1"], ConfigError),
    (
        "per-token-vs-agg",
        ["--calculate-per-token-loss", "--loss-agg-mode", "seq-mean-token-sum"],
        (),
        ["--calculate-per-token-loss", "--loss-agg-mode seq-mean-token-sum"],
        ConfigError,
    ),
    # sync: combination rules, checked before the in-process rule
    (
        "delta-needs-disk",
        ["--update-weight-mode", "delta"],
        (),
        ["--update-weight-mode delta", "--update-weight-transport disk"],
        ConfigError,
    ),
    (
        "delta-needs-disk-dir",
        ["--update-weight-mode", "delta", "--update-weight-transport", "disk"],
        (),
        ["--update-weight-mode delta", "--update-weight-disk-dir"],
        ConfigError,
    ),
    (
        "delta-needs-local-dir",
        ["--update-weight-mode", "delta", "--update-weight-transport", "disk", "--update-weight-disk-dir", "w"],
        (),
        ["--update-weight-mode delta", "--update-weight-local-checkpoint-dir"],
        ConfigError,
    ),
    (
        "delta-colocate",
        [
            "--update-weight-mode",
            "delta",
            "--update-weight-transport",
            "disk",
            "--update-weight-disk-dir",
            "w",
            "--update-weight-local-checkpoint-dir",
            "l",
            "--colocate",
        ],
        (),
        ["--update-weight-mode delta", "--colocate"],
        ConfigError,
    ),
    (
        "disk-needs-dir",
        ["--update-weight-transport", "disk"],
        (),
        ["--update-weight-transport disk", "--update-weight-disk-dir"],
        ConfigError,
    ),
    (
        "disk-dir-without-disk",
        ["--update-weight-disk-dir", "w"],
        (),
        ["--update-weight-disk-dir", "--update-weight-transport disk"],
        ConfigError,
    ),
    (
        "local-dir-without-delta",
        ["--update-weight-local-checkpoint-dir", "l"],
        (),
        ["--update-weight-local-checkpoint-dir", "--update-weight-mode delta"],
        ConfigError,
    ),
    (
        "full-interval-without-delta",
        ["--update-weight-full-interval", "4"],
        (),
        ["--update-weight-full-interval", "--update-weight-mode delta"],
        ConfigError,
    ),
    ("buffer-zero", ["--update-weight-buffer-size", "0"], (), ["--update-weight-buffer-size 0"], ConfigError),
    (
        "full-interval-zero",
        ["--update-weight-full-interval", "0"],
        (),
        ["--update-weight-full-interval 0"],
        ConfigError,
    ),
    # sync: the in-process engine refuses explicitly given server-engine transport/mode
    (
        "in-process-transport",
        ["--update-weight-transport", "nccl"],
        (),
        ["--update-weight-transport", "server engines", "direct tensor copy"],
        ConfigError,
    ),
    (
        "in-process-mode",
        ["--update-weight-mode", "full"],
        (),
        ["--update-weight-mode", "server engines", "direct tensor copy"],
        ConfigError,
    ),
    (
        "in-process-disk",
        ["--update-weight-transport", "disk", "--update-weight-disk-dir", "w"],
        (),
        ["--update-weight-transport", "server engines"],
        ConfigError,
    ),
    (
        "in-process-delta",
        [
            "--update-weight-mode",
            "delta",
            "--update-weight-transport",
            "disk",
            "--update-weight-disk-dir",
            "w",
            "--update-weight-local-checkpoint-dir",
            "l",
        ],
        (),
        ["--update-weight-transport", "server engines"],
        ConfigError,
    ),
    # checkpoint
    ("save-interval-no-save", ["--save-interval", "2"], (), ["--save-interval", "--save"], ConfigError),
    ("save-interval-zero", ["--save", "ck", "--save-interval", "0"], (), ["--save-interval 0"], ConfigError),
    ("load-missing", ["--load", "nope"], (), ["--load 'nope'", "no such directory"], ConfigError),
    ("save-is-file", ["--save", "afile"], (), ["--save 'afile'", "not a directory"], ConfigError),
    # eval
    (
        "eval-odd",
        ["--eval-prompt-data", "a", "eval.jsonl", "b"],
        (),
        ["--eval-prompt-data", "NAME PATH pairs"],
        ConfigError,
    ),
    (
        "eval-dup-name",
        ["--eval-prompt-data", "a", "eval.jsonl", "a", "eval.jsonl"],
        (),
        ["--eval-prompt-data", "'a' is used twice"],
        ConfigError,
    ),
    (
        "eval-missing-file",
        ["--eval-prompt-data", "a", "nope.jsonl"],
        (),
        ["--eval-prompt-data a", "'nope.jsonl'"],
        ConfigError,
    ),
    ("eval-interval-no-data", ["--eval-interval", "2"], (), ["--eval-interval", "--eval-prompt-data"], ConfigError),
    (
        "eval-interval-zero",
        ["--eval-prompt-data", "a", "eval.jsonl", "--eval-interval", "0"],
        (),
        ["--eval-interval 0"],
        ConfigError,
    ),
    ("eval-n-zero", ["--n-samples-per-eval-prompt", "0"], (), ["--n-samples-per-eval-prompt 0"], ConfigError),
    ("eval-temperature-neg", ["--eval-temperature", "-0.5"], (), ["--eval-temperature -0.5"], ConfigError),
    ("eval-top-p-zero", ["--eval-top-p", "0"], (), ["--eval-top-p 0.0"], ConfigError),
    ("eval-len-zero", ["--eval-max-response-len", "0"], (), ["--eval-max-response-len 0"], ConfigError),
    # observe
    ("wandb-project-empty", ["--wandb-project", ""], (), ["--wandb-project"], ConfigError),
    # partial rollout (lichen/config/sampling.py)
    (
        "partial-mask-alone",
        ["--mask-offpolicy-in-partial-rollout"],
        (),
        ["--mask-offpolicy-in-partial-rollout needs --partial-rollout"],
        ConfigError,
    ),
    (
        "partial-no-filter",
        ["--partial-rollout", "--rollout-num-engines", "2"],
        (),
        ["--partial-rollout needs --dynamic-sampling-filter-path", "nothing is aborted"],
        ConfigError,
    ),
    (
        "partial-in-process",
        ["--partial-rollout", "--dynamic-sampling-filter-path", PARTIAL_FILTER],
        (),
        ["--partial-rollout needs engine servers", "--rollout-num-engines K", "--rollout-external-engine-addrs"],
        ConfigError,
    ),
    (
        "partial-custom-generate",
        [
            "--partial-rollout",
            "--dynamic-sampling-filter-path",
            PARTIAL_FILTER,
            "--rollout-num-engines",
            "2",
            "--custom-generate-function-path",
            "lichen.rollout.examples.calculator_agent.generate",
        ],
        (),
        ["--partial-rollout with --custom-generate-function-path", "drop one of the two"],
        ConfigError,
    ),
]


@pytest.mark.parametrize("extra, drop, needles, exc", [r[1:] for r in REJECTIONS], ids=[r[0] for r in REJECTIONS])
def test_rule_rejects_and_names_the_flag(files, extra, drop, needles, exc):
    with pytest.raises(ConfigError) as info:
        parse(*extra, drop=drop)
    assert type(info.value) is exc, f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


@pytest.mark.parametrize("estimator", ["grpo", "gspo", "cispo", "rloo", "reinforce_plus_plus_baseline"])
def test_group_estimator_with_one_sample_is_rejected(files, estimator):
    extra = ["--advantage-estimator", estimator, "--n-samples-per-prompt", "1", "--normalize-advantages"]
    with pytest.raises(ConfigError) as info:
        parse(*extra)
    message = str(info.value)
    assert f"--advantage-estimator {estimator}" in message
    assert "--n-samples-per-prompt >= 2" in message and "--disable-rewards-normalization" in message


@pytest.mark.parametrize(
    "extra",
    [
        ["--advantage-estimator", "grpo", "--n-samples-per-prompt", "1", "--disable-rewards-normalization"],
        # plain REINFORCE++ normalizes over the batch, not the group: one sample per prompt is fine
        ["--advantage-estimator", "reinforce_plus_plus", "--n-samples-per-prompt", "1", "--normalize-advantages"],
    ],
)
def test_one_sample_per_prompt_allowed_without_group_normalization(files, extra):
    args = parse(*extra)
    assert args.n_samples_per_prompt == 1


def test_sync_combination_rules_come_before_the_in_process_rule(files):
    # Explicit transport with the in-process engine is also wrong, but the combination is reported first.
    with pytest.raises(ConfigError, match="--update-weight-mode delta needs --update-weight-transport disk"):
        parse("--update-weight-mode", "delta", "--update-weight-transport", "nccl")


@pytest.mark.parametrize("engines", [["--rollout-num-engines", "2"], ["--rollout-external-engine-addrs", "h:1"]])
def test_partial_rollout_passes_with_dynamic_sampling_over_servers(files, engines):
    args = parse(
        "--partial-rollout",
        "--mask-offpolicy-in-partial-rollout",
        "--dynamic-sampling-filter-path",
        PARTIAL_FILTER,
        *engines,
    )
    assert args.partial_rollout and args.mask_offpolicy_in_partial_rollout


def test_warmup_fraction_and_iters_exclude_each_other(files):
    with pytest.raises(ConfigError, match="--lr-warmup-fraction and --lr-warmup-iters both set the warm-up"):
        parse("--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "3")
    with pytest.raises(ConfigError, match="lr-warmup-fraction"):
        parse("--lr-warmup-fraction", "1.5")
