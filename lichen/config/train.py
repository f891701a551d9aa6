"""Training flags: run length, batch sizes, optimizer and schedule, loss type, old log-probs.

Batch arithmetic. One rollout step yields S = rollout_batch_size * n_samples_per_prompt samples, split into
num_steps_per_rollout optimizer steps of global_batch_size samples each, so S = global_batch_size *
num_steps_per_rollout exactly:
- only --global-batch-size given:     num_steps_per_rollout = S / global_batch_size
- only --num-steps-per-rollout given: global_batch_size = S / num_steps_per_rollout
- both given: they must agree; neither: one step of S samples.
Each optimizer step is accumulated over global_batch_size / micro_batch_size micro-batches (without dynamic
batching).
"""

from __future__ import annotations

import argparse

from lichen.config.checks import check_dotted_path, check_float, check_int_at_least, given
from lichen.config.train_config import compile_name_patterns
from lichen.errors import ConfigError


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument(
        "--num-rollout",
        type=int,
        default=None,
        help="rollout steps to run; exactly one of --num-rollout and --num-epoch is required",
    )
    g.add_argument(
        "--num-epoch",
        type=int,
        default=None,
        help="passes over --prompt-data (sets the number of rollout steps); exactly one of --num-rollout and "
        "--num-epoch is required",
    )
    g.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="samples per optimizer step (default: rollout-batch-size * n-samples-per-prompt / num-steps-per-rollout)",
    )
    g.add_argument(
        "--num-steps-per-rollout",
        type=int,
        default=1,
        help="optimizer steps per rollout step (default: 1, or the samples of a rollout step / "
        "--global-batch-size when that is given)",
    )
    g.add_argument(
        "--micro-batch-size",
        type=int,
        default=1,
        help="samples per forward/backward pass; must divide the global batch size",
    )
    g.add_argument(
        "--use-dynamic-batch-size",
        action="store_true",
        help="pack micro-batches by token count (--max-tokens-per-gpu) instead of --micro-batch-size (default: off)",
    )
    g.add_argument(
        "--max-tokens-per-gpu",
        type=int,
        default=None,
        help="token budget of one micro-batch; required with --use-dynamic-batch-size (default: none)",
    )
    g.add_argument(
        "--disable-zero-advantage-skip",
        action="store_true",
        help="run the backward of every sample, also of those whose loss terms are all exactly zero (zero "
        "advantage, no entropy/KL term); by default lichen skips those backwards, which changes no gradient and "
        "only saves time, and logs their count as train/skipped_samples. Turn it off to compare equal work with "
        "a framework that computes them (default: off, the skip is on)",
    )
    g.add_argument(
        "--disable-prompt-sharing",
        action="store_true",
        help="lay out every sample's prompt in the trainer; by default samples with identical prompt tokens in a "
        "packed row compute the prompt once, each response attending to it and to itself (the same "
        "log-probs and gradients up to rounding, fewer positions; docs/algorithms.md#prompt-sharing). Only with "
        "packed rows (CPU) and lichen's own model implementation (default: off, sharing is on)",
    )
    g.add_argument(
        "--log-probs-chunk-size",
        type=int,
        default=512,
        help="response positions whose [positions, vocabulary] logits the trainer holds at once: log-probs, "
        "entropy and their gradients are computed from the final hidden states in chunks of this many positions, "
        "the backward recomputing each chunk's logits, so no full [tokens, vocabulary] logits or gradient exist "
        "(the same values up to rounding; docs/performance.md#log-probs-without-the-vocabularys-memory). slime's "
        "flag; -1 (slime's default) or 0 computes the full logits at once (default: 512)",
    )
    g.add_argument("--lr", type=float, default=1e-6, help="peak learning rate (Adam)")
    g.add_argument("--min-lr", type=float, default=0.0, help="learning rate at the end of the decay")
    g.add_argument(
        "--lr-decay-style",
        choices=["constant", "linear", "cosine"],
        default="constant",
        help="learning-rate schedule after warm-up",
    )
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="optimizer steps of linear warm-up from 0")
    g.add_argument(
        "--lr-warmup-fraction",
        type=float,
        default=None,
        help="warm-up as a fraction of the decay length (--lr-decay-iters, else the run's optimizer steps, known "
        "once --num-epoch is resolved against the data): round(F x that) steps; excludes --lr-warmup-iters "
        "(slime's/Megatron's flag; default: none)",
    )
    g.add_argument(
        "--lr-decay-iters",
        type=int,
        default=None,
        help="optimizer steps over which the rate decays to --min-lr (default: the whole run)",
    )
    g.add_argument("--weight-decay", type=float, default=0.0, help="decoupled (AdamW) weight decay")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon")
    g.add_argument("--clip-grad", type=float, default=1.0, help="clip the global gradient norm to this; 0: off")
    g.add_argument(
        "--reset-optimizer-states",
        action="store_true",
        help="at the start of every rollout step's training, zero the optimizer's step counts and Adam moments "
        "(the policy's and the PPO critic's); the learning-rate schedule goes on (slime's flag; default: off)",
    )
    g.add_argument(
        "--optimizer-cpu-offload",
        action="store_true",
        help="keep the trainer's float32 parameter shards, their gradients and the AdamW state in host memory and "
        "step the optimizer on the CPU (FSDP2's CPUOffloadPolicy); each layer's parameters are copied to the GPU "
        "for its forward and backward. Saves the device memory of 16 bytes per parameter / trainer ranks for the "
        "cost of host-device copies and a CPU optimizer step; results are unchanged. --runtime ray only (the "
        "FSDP2 trainer ranks; one rank is fine); no effect on a CPU trainer, whose state is in host memory already. "
        "slime's (Megatron's) flag of the same name (default: off)",
    )
    g.add_argument(
        "--ci-train-rollout-logprob-abs-diff-threshold",
        type=float,
        default=None,
        help="stop the run (exit code 1, one line naming the step and the value) when train/"
        "train_rollout_logprob_abs_diff, the mean |trainer - engine| log-prob of the rollout's tokens, exceeds "
        "this. slime's flag, asserted there under --ci-test with default 0.1; a slime script's --ci-test sets "
        "0.1 here unless it gives the flag (default: no check)",
    )
    g.add_argument(
        "--loss-type",
        choices=["policy_loss", "sft_loss", "custom_loss"],
        default="policy_loss",
        help="policy_loss: the RL objective; sft_loss: negative log-likelihood of responses; custom_loss: "
        "--custom-loss-function-path",
    )
    g.add_argument(
        "--custom-loss-function-path",
        metavar="MODULE.FUNCTION",
        default=None,
        help="your loss as module.function; required by --loss-type custom_loss (default: none)",
    )
    g.add_argument(
        "--moe-aux-loss-coeff",
        type=float,
        default=0.0,
        help="weight of the MoE router's load-balancing loss added to the training loss: the transformers "
        "module's own load_balancing_loss_func (Switch-style, padding excluded) on the generic HF path, for MoE "
        "types whose module defines it (qwen3_moe, gpt_oss, qwen3_next, mixtral, ...); logged as "
        "train/moe_aux_loss. Megatron's flag (slime passes it; same default), but Megatron sums per-layer losses "
        "normalised by top-k, so the same value weighs differently (docs/models.md#moe). Ignored, with a warning, "
        "where the model has no such loss (default: 0.0, off)",
    )
    g.add_argument(
        "--force-recompute-old-log-probs",
        action="store_true",
        help="recompute old log-probs in a separate no-grad pass even when a single optimizer step per rollout "
        "makes them equal to the current ones, with a different micro-batch split, so the first-step ppo_kl = 0 "
        "invariant is actually checked (default: off, reuse the current log-probs)",
    )
    g.add_argument(
        "--use-rollout-logprobs",
        action="store_true",
        help="use the engine's log-probs as old log-probs instead of recomputing them (default: off)",
    )
    g.add_argument(
        "--balance-by-flops",
        action="store_true",
        help="slime's flag: split each optimizer step's samples into ceil(tokens / --max-tokens-per-gpu) "
        "micro-batches balanced by estimated forward FLOPs, coeff*L + L^2 per sample with coeff from config.json "
        "(Karmarkar-Karp), and deal them to trainer ranks by the same cost; a micro-batch may then exceed "
        "--max-tokens-per-gpu. Needs --use-dynamic-batch-size (docs/performance.md#balance-by-flops; default: off, "
        "first-fit by tokens)",
    )
    g.add_argument(
        "--only-train-params-name-list",
        nargs="+",
        metavar="REGEX",
        default=None,
        help="slime's flag: train only the parameters whose name matches one of these Python regexes (re.search); "
        "every other parameter is frozen (no gradient, not in the optimizer). With --use-lora the names are the "
        "adapters'. Each regex must match a parameter (docs/algorithms.md#training-a-subset-of-parameters; "
        "default: train all)",
    )
    g.add_argument(
        "--freeze-params-name-list",
        nargs="+",
        metavar="REGEX",
        default=None,
        help="slime's flag: freeze the parameters whose name matches one of these Python regexes (re.search); the "
        "rest train. With --use-lora the names are the adapters'. Each regex must match a parameter; excludes "
        "--only-train-params-name-list (default: freeze none)",
    )


def _resolve_batch(args: argparse.Namespace) -> None:
    per_rollout = args.rollout_batch_size * args.n_samples_per_prompt
    shape = (
        f"--rollout-batch-size {args.rollout_batch_size} x --n-samples-per-prompt {args.n_samples_per_prompt} = "
        f"{per_rollout} samples per rollout step"
    )
    check_int_at_least(args, "num_steps_per_rollout", 1)
    check_int_at_least(args, "global_batch_size", 1)
    gbs, steps = args.global_batch_size, args.num_steps_per_rollout
    if gbs is not None and given(args, "num_steps_per_rollout"):
        if gbs * steps != per_rollout:
            raise ConfigError(
                f"--global-batch-size {gbs} and --num-steps-per-rollout {steps} disagree: {shape}, but {gbs} x "
                f"{steps} = {gbs * steps}; give only one of them"
            )
    elif gbs is not None:
        if per_rollout % gbs:
            raise ConfigError(
                f"--global-batch-size {gbs} does not divide the rollout: {shape}; pick a divisor of {per_rollout}"
            )
        args.num_steps_per_rollout = per_rollout // gbs
    else:
        if per_rollout % steps:
            raise ConfigError(
                f"--num-steps-per-rollout {steps} does not divide the rollout: {shape}; pick a divisor of {per_rollout}"
            )
        args.global_batch_size = per_rollout // steps
    check_int_at_least(args, "micro_batch_size", 1)
    if args.use_dynamic_batch_size:
        if args.max_tokens_per_gpu is None:
            raise ConfigError(
                "--use-dynamic-batch-size needs --max-tokens-per-gpu N: the token budget of one micro-batch"
            )
    elif args.global_batch_size % args.micro_batch_size:
        raise ConfigError(
            f"--micro-batch-size {args.micro_batch_size} does not divide the global batch size "
            f"{args.global_batch_size} (--global-batch-size); pick a divisor"
        )
    check_int_at_least(args, "max_tokens_per_gpu", 1)


def check(args: argparse.Namespace) -> None:
    if (args.num_rollout is None) == (args.num_epoch is None):
        which = "both were given" if args.num_rollout is not None else "neither was given"
        raise ConfigError(f"give exactly one of --num-rollout N and --num-epoch N to set the run length ({which})")
    check_int_at_least(args, "num_rollout", 1)
    check_int_at_least(args, "num_epoch", 1)
    if args.num_epoch is not None and args.prompt_data is None:
        raise ConfigError("--num-epoch counts passes over --prompt-data, which is not given; use --num-rollout N")
    _resolve_batch(args)
    check_float(args, "lr", low=0.0)
    check_float(args, "min_lr", low=0.0)
    if args.min_lr > args.lr:
        raise ConfigError(f"--min-lr {args.min_lr} is above --lr {args.lr}; the decay ends at --min-lr")
    check_int_at_least(args, "lr_warmup_iters", 0)
    check_float(args, "lr_warmup_fraction", low=0.0, high=1.0)
    if args.lr_warmup_fraction is not None and given(args, "lr_warmup_iters"):
        raise ConfigError("--lr-warmup-fraction and --lr-warmup-iters both set the warm-up; give one of them")
    check_int_at_least(args, "lr_decay_iters", 1)
    check_float(args, "weight_decay", low=0.0)
    check_float(args, "adam_beta1", low=0.0, high=1.0, high_open=True)
    check_float(args, "adam_beta2", low=0.0, high=1.0, high_open=True)
    check_float(args, "adam_eps", low=0.0, low_open=True)
    check_float(args, "clip_grad", low=0.0)
    check_float(args, "ci_train_rollout_logprob_abs_diff_threshold", low=0.0)
    check_float(args, "moe_aux_loss_coeff", low=0.0)
    if args.loss_type == "custom_loss" and args.custom_loss_function_path is None:
        raise ConfigError("--loss-type custom_loss needs --custom-loss-function-path module.function")
    if args.loss_type != "custom_loss" and args.custom_loss_function_path is not None:
        raise ConfigError(
            f"--custom-loss-function-path is only used with --loss-type custom_loss (got --loss-type "
            f"{args.loss_type}); add --loss-type custom_loss or drop the path"
        )
    check_dotted_path(args, "custom_loss_function_path")
    if args.optimizer_cpu_offload and getattr(args, "runtime", "local") != "ray":
        raise ConfigError(
            "--optimizer-cpu-offload needs --runtime ray: it is FSDP2's CPU offload of the trainer ranks (one rank is "
            "fine: --actor-num-gpus-per-node 1); drop it for --runtime local"
        )
    _check_param_filter(args)
    if args.balance_by_flops and not args.use_dynamic_batch_size:
        raise ConfigError(
            "--balance-by-flops balances the micro-batches of --use-dynamic-batch-size (their count comes from "
            "--max-tokens-per-gpu); add --use-dynamic-batch-size --max-tokens-per-gpu N or drop --balance-by-flops"
        )
    if args.use_rollout_logprobs and args.force_recompute_old_log_probs:
        raise ConfigError(
            "--use-rollout-logprobs and --force-recompute-old-log-probs exclude each other: old log-probs come "
            "either from the engine or from a trainer pass; drop one"
        )


def _check_param_filter(args: argparse.Namespace) -> None:
    """One of the two parameter-name flags, every entry a valid regex (whether each matches a parameter is checked
    when the trainer builds the model)."""
    if args.only_train_params_name_list and args.freeze_params_name_list:
        raise ConfigError(
            "--only-train-params-name-list and --freeze-params-name-list exclude each other (as in slime): name the "
            "parameters to train, or the ones to freeze"
        )
    compile_name_patterns(args.only_train_params_name_list, "--only-train-params-name-list")
    compile_name_patterns(args.freeze_params_name_list, "--freeze-params-name-list")
