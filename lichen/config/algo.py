"""Algorithm flags: advantage estimator, reward normalization, clipping, KL terms, entropy, loss aggregation."""

from __future__ import annotations

import argparse

from lichen.config import rollout_config
from lichen.config.checks import check_dotted_path, check_float, check_hf_dir, given
from lichen.errors import ConfigError

ESTIMATORS = ("grpo", "gspo", "cispo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
# Estimators whose advantage is a reward minus a statistic of the prompt's group: with one sample per group and
# group reward normalization, reward - mean(group) is 0 for every sample.
GROUP_ESTIMATORS = ("grpo", "gspo", "cispo", "rloo", "reinforce_plus_plus_baseline")
LOSS_AGG_MODES = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("algorithm")
    g.add_argument(
        "--advantage-estimator",
        choices=ESTIMATORS,
        default="grpo",
        help="how advantages are computed from rewards; ppo trains a critic (value model) and uses GAE",
    )
    g.add_argument(
        "--disable-rewards-normalization",
        action="store_true",
        help="do not subtract the group mean from rewards (default: off, rewards are group-normalized)",
    )
    g.add_argument(
        "--disable-grpo-std-normalization",
        action="store_true",
        help="do not divide by the group's reward std, as in Dr. GRPO (default: off, divide)",
    )
    g.add_argument(
        "--normalize-advantages",
        action="store_true",
        help="whiten advantages over the batch's response tokens; required by reinforce_plus_plus* (default: off)",
    )
    g.add_argument("--eps-clip", type=float, default=0.2, help="PPO ratio clip: ratio in [1 - eps, 1 + eps_high]")
    g.add_argument(
        "--eps-clip-high",
        type=float,
        default=None,
        help="upper PPO ratio clip (default: --eps-clip)",
    )
    g.add_argument(
        "--eps-clip-c",
        type=float,
        default=None,
        help="dual-clip constant for negative advantages, > 1 (default: no dual clip)",
    )
    g.add_argument(
        "--use-opsm",
        action="store_true",
        help="off-policy sequence masking: drop negative-advantage sequences too far off-policy (default: off)",
    )
    g.add_argument("--opsm-delta", type=float, default=1e-4, help="threshold of --use-opsm")
    g.add_argument("--entropy-coef", type=float, default=0.0, help="weight of the entropy bonus")
    g.add_argument(
        "--use-kl-loss",
        action="store_true",
        help="add a KL(policy || reference) term to the loss, weighted by --kl-loss-coef (default: off)",
    )
    g.add_argument("--kl-loss-coef", type=float, default=0.0, help="weight of the KL loss term (needs --use-kl-loss)")
    g.add_argument(
        "--kl-loss-type",
        choices=["k1", "k2", "k3", "low_var_kl"],
        default="k1",
        help="KL estimator of the KL loss term",
    )
    g.add_argument(
        "--use-unbiased-kl",
        action="store_true",
        help="importance-weight the KL estimate by the policy ratio (default: off)",
    )
    g.add_argument(
        "--kl-coef",
        type=float,
        default=0.0,
        help="weight of a KL penalty subtracted from the reward (not combinable with --kl-loss-coef)",
    )
    g.add_argument(
        "--critic-load",
        default=None,
        help="HF checkpoint the PPO critic's backbone starts from (default: --hf-checkpoint)",
    )
    g.add_argument("--critic-lr", type=float, default=None, help="learning rate of the PPO critic (default: --lr)")
    g.add_argument(
        "--value-clip",
        type=float,
        default=0.2,
        help="PPO value clipping: the new value may move at most this far from the old one (default 0.2)",
    )
    g.add_argument(
        "--num-critic-only-steps",
        type=int,
        default=0,
        help="train only the critic for the first N rollout steps (default 0)",
    )
    g.add_argument("--gamma", type=float, default=1.0, help="discount factor of returns")
    g.add_argument("--lambd", type=float, default=1.0, help="GAE lambda")
    g.add_argument(
        "--loss-agg-mode",
        choices=LOSS_AGG_MODES,
        default="seq-mean-token-mean",
        help="how per-token losses reduce to one number",
    )
    g.add_argument(
        "--use-tis",
        action="store_true",
        help="truncated importance sampling: weight each token's policy loss by pi_old / pi_rollout (trainer vs "
        "engine log-probs), clipped to [--tis-clip-low, --tis-clip] (default: off)",
    )
    g.add_argument("--tis-clip", type=float, default=2.0, help="upper bound of the TIS weight (default 2.0)")
    g.add_argument("--tis-clip-low", type=float, default=0.0, help="lower bound of the TIS weight (default 0.0)")
    g.add_argument(
        "--tis-mode",
        choices=["truncate", "icepop"],
        default="truncate",
        help="truncate: clip weights into the band; icepop: weights outside the band become 0 (default truncate)",
    )
    g.add_argument(
        "--custom-tis-function-path",
        default=None,
        help="module.fn(args, *, old_log_probs, rollout_log_probs, mask) -> per-token weights [b, R], replacing "
        "the built-in TIS weight (needs --use-tis; default: none)",
    )
    g.add_argument(
        "--custom-advantage-function-path",
        default=None,
        help="module.fn(args, samples, *, rewards, mask, kl) -> per-token advantages [B, R], replacing "
        "--advantage-estimator's computation (default: none)",
    )
    g.add_argument(
        "--custom-pg-loss-reducer-function-path",
        default=None,
        help="module.fn(per_token, mask, *, global_num_samples, global_num_tokens, max_response_len) -> this "
        "micro-batch's share of the policy loss, replacing --loss-agg-mode for the policy-gradient term (default: none)",
    )
    g.add_argument(
        "--use-opd",
        action="store_true",
        help="on-policy distillation: advantage -= --opd-kl-coef * (log pi - log pi_teacher) per token, the "
        "teacher's log-probs as --opd-type says (default: off)",
    )
    g.add_argument(
        "--opd-type",
        choices=["megatron", "sglang"],
        default=None,
        help="where --use-opd's teacher log-probs come from (slime's names): megatron = the trainer scores the "
        "teacher --opd-teacher-load itself; sglang = the rollout asks the teacher's engine servers (the frozen "
        "model named 'teacher', or the only frozen model, of --sglang-config) for each response's log-probs, "
        "stored per sample as teacher_log_probs (default: megatron)",
    )
    g.add_argument("--opd-kl-coef", type=float, default=1.0, help="weight of the distillation term (default 1.0)")
    g.add_argument("--opd-teacher-load", default=None, help="teacher HF checkpoint directory for --use-opd")
    g.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="alias of --loss-agg-mode token-mean (default: off)",
    )


def given_set(args: argparse.Namespace) -> set:
    return set(getattr(args, "_explicit", set()))


def check(args: argparse.Namespace) -> None:
    estimator = args.advantage_estimator
    if estimator != "ppo":
        for dest, flag in (("critic_load", "--critic-load"), ("critic_lr", "--critic-lr")):
            if getattr(args, dest) is not None:
                raise ConfigError(f"{flag} is only used with --advantage-estimator ppo (the critic); drop it")
        if args.num_critic_only_steps:
            raise ConfigError("--num-critic-only-steps is only used with --advantage-estimator ppo; drop it")
    if estimator == "ppo" and args.loss_type != "policy_loss":
        raise ConfigError(
            f"--advantage-estimator ppo trains a critic for the policy loss; it cannot be combined with "
            f"--loss-type {args.loss_type}"
        )
    if args.kl_coef != 0 and estimator not in ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"):
        raise ConfigError(
            f"--kl-coef (KL in the reward) is used by reinforce_plus_plus, reinforce_plus_plus_baseline "
            f"and ppo, not by --advantage-estimator {estimator}; use --use-kl-loss --kl-loss-coef instead"
        )
    if args.eps_clip_c is not None and estimator in ("gspo", "cispo"):
        raise ConfigError(
            f"--eps-clip-c (dual clip) applies to the PPO-style token loss, not to "
            f"--advantage-estimator {estimator}; drop it"
        )
    if args.custom_advantage_function_path is not None and estimator == "ppo":
        raise ConfigError(
            "--custom-advantage-function-path replaces group-based estimators; with "
            "--advantage-estimator ppo advantages come from the critic (GAE); drop one"
        )
    if args.disable_rewards_normalization and estimator in ("rloo", "reinforce_plus_plus", "ppo"):
        raise ConfigError(
            f"--disable-rewards-normalization has no effect with --advantage-estimator {estimator} "
            f"(it does not group-normalize rewards); drop it"
        )
    if args.num_critic_only_steps < 0:
        raise ConfigError(f"--num-critic-only-steps {args.num_critic_only_steps}: must be >= 0")
    if args.value_clip is not None and args.value_clip <= 0:
        raise ConfigError(f"--value-clip {args.value_clip}: must be > 0 (default 0.2)")
    if args.critic_load is not None:
        check_hf_dir(args.critic_load, "--critic-load")
    if estimator.startswith("reinforce_plus_plus") and not args.normalize_advantages:
        raise ConfigError(
            f"--advantage-estimator {estimator} needs --normalize-advantages (REINFORCE++ whitens advantages over "
            "the batch); add it"
        )
    uses_advantages = getattr(args, "loss_type", "policy_loss") == "policy_loss"  # sft_loss ignores them
    if (
        uses_advantages
        and not args.disable_rewards_normalization
        and args.n_samples_per_prompt == 1
        and estimator in GROUP_ESTIMATORS
    ):
        raise ConfigError(
            f"--advantage-estimator {estimator} with --n-samples-per-prompt 1 and group reward normalization: every "
            "advantage would be 0 (a reward minus the mean of a group of one); use --n-samples-per-prompt >= 2 or "
            "--disable-rewards-normalization"
        )
    if args.use_tis and args.use_rollout_logprobs:
        raise ConfigError(
            "--use-tis and --use-rollout-logprobs exclude each other: TIS reweights trainer-old log-probs against "
            "the engine's, which --use-rollout-logprobs makes identical; drop one"
        )
    if not args.use_tis and (args.custom_tis_function_path is not None or "tis_mode" in given_set(args)):
        raise ConfigError("--custom-tis-function-path and --tis-mode need --use-tis")
    if args.use_tis and not (0.0 <= args.tis_clip_low < 1.0 < args.tis_clip):
        raise ConfigError(f"--tis-clip-low {args.tis_clip_low} / --tis-clip {args.tis_clip}: need 0 <= low < 1 < high")
    check_dotted_path(args, "custom_tis_function_path")
    check_dotted_path(args, "custom_advantage_function_path")
    check_dotted_path(args, "custom_pg_loss_reducer_function_path")
    _check_opd(args)
    if not args.use_opd and args.opd_teacher_load is not None:
        raise ConfigError("--opd-teacher-load is only used with --use-opd; add --use-opd or drop it")
    if args.opd_teacher_load is not None:
        check_hf_dir(args.opd_teacher_load, "--opd-teacher-load")
    check_float(args, "eps_clip", low=0.0, low_open=True)
    if args.eps_clip_high is None:
        args.eps_clip_high = args.eps_clip
    check_float(args, "eps_clip_high", low=0.0, low_open=True)
    check_float(args, "eps_clip_c", low=1.0, low_open=True)
    check_float(args, "opsm_delta", low=0.0, low_open=True)
    check_float(args, "entropy_coef", low=0.0)
    check_float(args, "kl_loss_coef", low=0.0)
    check_float(args, "kl_coef", low=0.0)
    if args.kl_coef != 0 and args.kl_loss_coef != 0:
        raise ConfigError(
            f"--kl-coef {args.kl_coef} and --kl-loss-coef {args.kl_loss_coef} are both non-zero: pick one KL term "
            "(a reward penalty or a loss term), set the other to 0"
        )
    if args.kl_loss_coef > 0 and not args.use_kl_loss:
        raise ConfigError(f"--kl-loss-coef {args.kl_loss_coef} has no effect without --use-kl-loss; add --use-kl-loss")
    check_float(args, "gamma", low=0.0, high=1.0)
    check_float(args, "lambd", low=0.0, high=1.0)
    if args.calculate_per_token_loss:
        if given(args, "loss_agg_mode") and args.loss_agg_mode != "token-mean":
            raise ConfigError(
                f"--calculate-per-token-loss means --loss-agg-mode token-mean, but --loss-agg-mode "
                f"{args.loss_agg_mode} was given; drop one"
            )
        args.loss_agg_mode = "token-mean"


def _check_opd(args: argparse.Namespace) -> None:
    """--use-opd's teacher: --opd-teacher-load for the trainer (megatron), a served frozen model (sglang)."""
    if args.opd_type is not None and not args.use_opd:
        raise ConfigError(f"--opd-type {args.opd_type} is only used with --use-opd; add --use-opd or drop it")
    if not args.use_opd:
        return
    if args.opd_type is None:
        args.opd_type = "megatron"
    if args.opd_type == "megatron" and args.opd_teacher_load is None:
        raise ConfigError("--use-opd needs a teacher: add --opd-teacher-load HF_CHECKPOINT_DIR (or --opd-type sglang)")
    if args.opd_type == "sglang":
        if args.opd_teacher_load is not None:
            raise ConfigError(
                "--opd-type sglang asks the teacher's servers (--sglang-config), so --opd-teacher-load is not used; "
                "drop it, or use --opd-type megatron"
            )
        rollout_config.opd_teacher_name([spec.name for spec in getattr(args, "sglang_frozen_models", ())])
