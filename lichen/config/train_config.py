"""The trainer's own configuration, resolved once from the parsed flags.

`TrainerConfig.from_args(args)` reads the resolved argparse namespace (defaults live in argparse only) after the
run length is known (`--num-epoch` needs the data set size), so the learning-rate decay length is a value of the
config rather than a field the loop writes into `args`. lichen's trainer components take these dataclasses; only
user plug-ins (custom loss, advantage and TIS functions) receive the full `args` namespace.

`TrainerConfig` is composed of one part per component, each knob one field of one part: `models` (ModelsConfig:
checkpoints, device, numerics), `batching` (BatchingConfig: optimizer steps, micro-batches), `advantage`
(AdvantageConfig: lichen.train.advantage), `loss` (LossConfig: lichen.train.loss), `critic` (CriticConfig),
`optimizer` (OptimizerConfig, the policy's), `optimizer_state`, `lora` (LoraConfig), `param_filter`, `checkpoint`
and `debug`.

Nothing here imports torch: `lichen train --dry-run` stays fast.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, TypeVar

from lichen.config.lora_config import LoraConfig
from lichen.config.model_code import model_options
from lichen.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_Part = TypeVar("_Part", bound="DataclassInstance")


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW, gradient clipping and the learning-rate schedule (lichen.train.lr_schedule)."""

    lr: float
    min_lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    clip_grad: float  # 0: no clipping (the norm is still measured)
    warmup_iters: int
    decay_iters: int  # --lr-decay-iters, else every optimizer step of the run
    decay_style: str

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, lr: float | None = None, weight_decay: float | None = None
    ) -> "OptimizerConfig":
        """`lr` and `weight_decay` override --lr and --weight-decay (the critic's --critic-lr, LoRA's
        --lora-learning-rate and --lora-weight-decay); the decay length needs args.num_rollout resolved."""
        return cls(
            lr=args.lr if lr is None else lr,
            min_lr=args.min_lr,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_eps,
            weight_decay=args.weight_decay if weight_decay is None else weight_decay,
            clip_grad=args.clip_grad,
            warmup_iters=warmup_iters(args),
            decay_iters=args.lr_decay_iters or total_optimizer_steps(args),
            decay_style=args.lr_decay_style,
        )


def warmup_iters(args: argparse.Namespace) -> int:
    """--lr-warmup-iters, or round(--lr-warmup-fraction x the decay length) (Megatron's rule)."""
    fraction = getattr(args, "lr_warmup_fraction", None)
    if fraction is None:
        return args.lr_warmup_iters
    return round(fraction * (args.lr_decay_iters or total_optimizer_steps(args)))


def total_optimizer_steps(args: argparse.Namespace) -> int:
    """Optimizer steps of the whole run: one per global batch, num_steps_per_rollout per rollout step."""
    return args.num_rollout * args.num_steps_per_rollout


@dataclass(frozen=True)
class ModelsConfig:
    """Which models the trainer loads and how it runs them (lichen.train.actor, lichen.train.critic, log-probs)."""

    hf_checkpoint: str
    ref_load: str | None  # the reference model (else --hf-checkpoint)
    critic_load: str | None  # the critic's backbone (else --hf-checkpoint)
    opd_teacher_load: str | None  # the distillation teacher of --use-opd
    device: str
    model_impl: str  # --model-impl (lichen.models.loading)
    trust_remote_code: bool
    qwen_gdn_backend: str | None
    seed: int
    bf16: bool
    gradient_checkpointing: bool
    temperature: float  # --rollout-temperature: log-probs are of the sampling distribution

    @property
    def model_options(self) -> dict:
        """load_model's keyword arguments for the code that runs the model (--model-impl and friends)."""
        return model_options(self)


@dataclass(frozen=True)
class BatchingConfig:
    """How a step's samples become optimizer steps and micro-batches (lichen.train.step_schedule,
    lichen.train.micro_batches, lichen.train.flops_balance, lichen.train.chunked_logprobs)."""

    num_steps_per_rollout: int
    micro_batch_size: int
    use_dynamic_batch_size: bool
    max_tokens_per_gpu: int | None
    balance_by_flops: bool  # micro-batches balanced by FLOPs (lichen.train.flops_balance)
    disable_zero_advantage_skip: bool  # no backward is skipped (lichen.train.step_schedule)
    disable_prompt_sharing: bool  # every sample computes its own prompt (lichen.train.micro_batches.PromptGroups)
    log_probs_chunk_size: int  # <= 0: full logits at once (lichen.train.chunked_logprobs)


@dataclass(frozen=True)
class AdvantageConfig:
    """The advantage estimator and the reward-side KL and distillation terms (lichen.train.advantage)."""

    advantage_estimator: str  # also picks the policy loss of gspo / cispo (lichen.train.loss)
    reward_key: str | None
    normalize_advantages: bool
    disable_rewards_normalization: bool
    disable_grpo_std_normalization: bool
    gamma: float
    lambd: float
    kl_coef: float  # the KL penalty folded into rewards (its estimator is --kl-loss-type)
    use_opd: bool
    opd_kl_coef: float
    custom_advantage_function_path: str | None


@dataclass(frozen=True)
class LossConfig:
    """The policy loss of a train step and the old policy it is measured against (lichen.train.loss)."""

    loss_type: str
    loss_agg_mode: str  # the critic's value loss aggregates the same way
    max_response_len: int  # --rollout-max-response-len, the "seq-mean-token-sum-norm" denominator
    # the old log-probs of the ratio: the engine's, or recomputed by the trainer
    use_rollout_logprobs: bool
    force_recompute_old_log_probs: bool
    eps_clip: float
    eps_clip_high: float  # --eps-clip when not given (lichen.config.algo resolves it)
    eps_clip_c: float | None
    use_opsm: bool
    opsm_delta: float
    entropy_coef: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str  # the KL estimator, of the loss term and of --kl-coef's reward penalty
    use_unbiased_kl: bool
    use_tis: bool
    tis_mode: str
    tis_clip: float
    tis_clip_low: float
    moe_aux_loss_coeff: float  # the router's load-balancing loss (lichen.train.router_aux)
    custom_loss_function_path: str | None
    custom_pg_loss_reducer_function_path: str | None
    custom_tis_function_path: str | None


@dataclass(frozen=True)
class CriticConfig:
    """The PPO critic of --advantage-estimator ppo (lichen.train.critic); its backbone is `ModelsConfig.critic_load`."""

    value_clip: float | None
    num_critic_only_steps: int
    optimizer: OptimizerConfig  # --critic-lr (default --lr) with the policy's AdamW settings


@dataclass(frozen=True)
class ParamFilterConfig:
    """Which parameters train (lichen.train.param_filter): regexes over names, at most one of the two lists."""

    only_train_params_name_list: list[str] | None
    freeze_params_name_list: list[str] | None


@dataclass(frozen=True)
class OptimizerStateConfig:
    """What becomes of the AdamW state, the policy's and the critic's (slime's optimizer flags)."""

    reset_optimizer_states: bool  # Adam moments and steps zeroed before every rollout step's training
    optimizer_cpu_offload: bool  # FSDP2 CPUOffloadPolicy on CUDA trainer ranks (lichen.train.fsdp.shard)


@dataclass(frozen=True)
class CheckpointConfig:
    """What a checkpoint save writes besides the trainer's state (lichen.train.checkpoint, DistTrainer.save)."""

    no_save_optim: bool  # checkpoints without optimizer state
    save_hf: str | None  # an HF export to save_hf.format(rollout_id=N) at every checkpoint save


@dataclass(frozen=True)
class DebugConfig:
    """Debugging and CI checks of the train step."""

    save_debug_train_data: str | None  # a dump of what each step trained on, to this path template
    ci_train_rollout_logprob_abs_diff_threshold: float | None  # the mismatch bound (lichen.train.step_metrics)


@dataclass(frozen=True)
class TrainerConfig:
    """Everything lichen.train.TrainActor and its phases read, one part per component: each component takes the
    part it reads (`cfg.loss` for lichen.train.loss, `cfg.advantage` for lichen.train.advantage, ...)."""

    models: ModelsConfig
    batching: BatchingConfig
    advantage: AdvantageConfig
    loss: LossConfig
    critic: CriticConfig
    optimizer: OptimizerConfig  # the policy's; with --use-lora the adapters' (LoRA's learning rate and weight decay)
    optimizer_state: OptimizerStateConfig
    lora: LoraConfig | None  # --use-lora (lichen.train.lora)
    param_filter: ParamFilterConfig
    checkpoint: CheckpointConfig
    debug: DebugConfig

    @property
    def needs_ref_model(self) -> bool:
        return self.loss.use_kl_loss or self.advantage.kl_coef != 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TrainerConfig":
        """Each part from the flags of the same names (dests), but for the few given here."""
        lora = LoraConfig.from_args(args)
        return cls(
            models=from_same_named_flags(ModelsConfig, args, temperature=args.rollout_temperature),
            batching=from_same_named_flags(BatchingConfig, args),
            advantage=from_same_named_flags(AdvantageConfig, args),
            loss=from_same_named_flags(LossConfig, args, max_response_len=args.rollout_max_response_len),
            critic=from_same_named_flags(
                CriticConfig, args, optimizer=OptimizerConfig.from_args(args, lr=args.critic_lr or args.lr)
            ),
            optimizer=OptimizerConfig.from_args(args)
            if lora is None
            else OptimizerConfig.from_args(args, lr=lora.lr, weight_decay=lora.weight_decay),
            optimizer_state=from_same_named_flags(OptimizerStateConfig, args),
            lora=lora,
            param_filter=from_same_named_flags(ParamFilterConfig, args),
            checkpoint=from_same_named_flags(CheckpointConfig, args),
            debug=from_same_named_flags(DebugConfig, args),
        )


def from_same_named_flags(cls: type[_Part], args: argparse.Namespace, **given: Any) -> _Part:
    """`cls(**given)`, every other field read from the flag of the same name (dest) in the resolved `args`."""
    names = [f.name for f in fields(cls) if f.name not in given]
    return cls(**{name: getattr(args, name) for name in names}, **given)


def compile_name_patterns(patterns: list[str] | None, flag: str) -> list[re.Pattern[str]]:
    """The regexes of --only-train-params-name-list / --freeze-params-name-list, compiled; a bad one is a
    ConfigError naming the flag (lichen.train.param_filter matches them against parameter names)."""
    out = []
    for pattern in patterns or []:
        try:
            out.append(re.compile(pattern))
        except re.error as e:
            raise ConfigError(f"{flag}: {pattern!r} is not a Python regular expression ({e}); fix or drop it") from None
    return out


def save_hf_dir(template: str, rollout_id: int) -> str:
    """Where --save-hf writes the export of checkpoint `rollout_id` (slime's `save_hf.format(rollout_id=...)`)."""
    return template.format(rollout_id=rollout_id)
