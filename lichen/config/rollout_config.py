"""The rollout side's typed configs, resolved once from the validated flags.

lichen's rollout components (the rollout worker, the default rollout and eval functions, the partial-rollout and
abort-surplus rounds) read these; user plug-ins keep receiving the full `args` namespace. Defaults live in
argparse: `from_args` reads the resolved namespace as it is.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from lichen.config.model_code import model_options
from lichen.errors import ConfigError


@dataclass(frozen=True)
class SamplingConfig:
    """How one batch of samples is drawn from the engines."""

    n_samples_per_prompt: int
    temperature: float
    top_p: float
    top_k: int
    max_response_len: int
    max_context_len: int | None  # None: no context ceiling (the response length alone bounds a request)
    stop_token_ids: tuple[int, ...]
    seed: int

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "SamplingConfig":
        return cls(
            n_samples_per_prompt=args.n_samples_per_prompt,
            temperature=args.rollout_temperature,
            top_p=args.rollout_top_p,
            top_k=args.rollout_top_k,
            max_response_len=args.rollout_max_response_len,
            max_context_len=args.rollout_max_context_len,
            stop_token_ids=tuple(args.rollout_stop_token_ids or ()),
            seed=args.seed,
        )

    def for_eval(self, dataset: dict) -> "SamplingConfig":
        """This sampling with an eval data set's own settings (an entry of RolloutConfig.eval_datasets)."""
        return replace(
            self,
            n_samples_per_prompt=dataset["n_samples_per_eval_prompt"],
            temperature=dataset["temperature"],
            top_p=dataset["top_p"],
            top_k=dataset["top_k"],
            max_response_len=dataset["max_response_len"],
        )

    def response_budget(self, num_tokens: int, max_new_tokens: int) -> int:
        """Tokens a sample holding `num_tokens` may still generate: min(max_new_tokens, --rollout-max-context-len -
        num_tokens), slime's rule. The request carries it, so the in-process engine, lichen serve and SGLang all
        generate within the same budget; prompts with no room were dropped when the data loaded (lichen.data.fit)."""
        if self.max_context_len is None:
            return max_new_tokens
        return min(max_new_tokens, self.max_context_len - num_tokens)


@dataclass(frozen=True)
class RewardConfig:
    """How rewards are computed (lichen.rewards): the reward, the runner's limits, the code sandbox, the remote RM."""

    rm_type: str | None
    custom_rm_path: str | None
    group_rm: bool
    reward_key: str | None
    concurrency: int
    timeout: float | None
    code_timeout: float
    code_memory_mb: int
    code_max_procs: int
    code_max_file_mb: int
    code_sandbox_python: str | None
    code_sandbox_uid_base: int
    rm_url: str | None
    rm_max_retries: int
    rm_retry_backoff: float
    rm_api_key_file: str | None
    sample_hook_paths: tuple[str, ...] = ()  # --rollout-sample-hook-path: run on each sample before its reward

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RewardConfig":
        return cls(
            rm_type=args.rm_type,
            custom_rm_path=args.custom_rm_path,
            group_rm=bool(args.group_rm),
            reward_key=args.reward_key,
            concurrency=args.reward_concurrency,
            timeout=args.reward_timeout,
            code_timeout=args.code_timeout,
            code_memory_mb=args.code_memory_mb,
            code_max_procs=args.code_max_procs,
            code_max_file_mb=args.code_max_file_mb,
            code_sandbox_python=args.code_sandbox_python,
            code_sandbox_uid_base=args.code_sandbox_uid_base,
            rm_url=args.rm_url,
            rm_max_retries=args.rm_max_retries,
            rm_retry_backoff=args.rm_retry_backoff,
            rm_api_key_file=args.rm_api_key_file,
            sample_hook_paths=tuple(args.rollout_sample_hook_path or ()),
        )


@dataclass(frozen=True)
class DataConfig:
    """Where the prompts come from and how they are walked."""

    prompt_data: str
    input_key: str
    label_key: str | None
    metadata_key: str | None
    tool_key: str | None
    skip_bad_rows: bool
    apply_chat_template: bool
    max_prompt_len: int | None
    max_prompt_chars: int | None  # --max-prompt-chars: longer prompts are dropped untokenized (lichen.data.fit)
    max_row_bytes: int | None  # --max-row-bytes: longer JSONL rows are dropped unread (lichen.data.dataset)
    batch_size: int
    shuffle: bool
    seed: int

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "DataConfig":
        return cls(
            prompt_data=args.prompt_data,
            input_key=args.input_key,
            label_key=args.label_key,
            metadata_key=args.metadata_key,
            tool_key=args.tool_key,
            skip_bad_rows=bool(args.skip_bad_rows),
            apply_chat_template=bool(args.apply_chat_template),
            max_prompt_len=args.rollout_max_prompt_len,
            max_prompt_chars=args.max_prompt_chars,
            max_row_bytes=args.max_row_bytes,
            batch_size=args.rollout_batch_size,
            shuffle=bool(args.rollout_shuffle),
            seed=args.rollout_seed,
        )

    @property
    def record_keys(self) -> dict:
        """The keyword arguments of lichen.data.load_prompt_dataset naming the record's fields."""
        return dict(
            input_key=self.input_key, label_key=self.label_key, metadata_key=self.metadata_key, tool_key=self.tool_key
        )


@dataclass(frozen=True)
class RolloutConfig:
    """Everything lichen's rollout side reads (see the module docstring)."""

    hf_checkpoint: str
    device: str
    model_options: dict  # load_model's impl / trust_remote_code / gdn_backend (--model-impl and friends)
    engine_max_batch_size: int
    use_engine_servers: bool  # --rollout-num-engines or --rollout-external-engine-addrs
    data: DataConfig
    sampling: SamplingConfig
    reward: RewardConfig
    rollout_function_path: str | None
    eval_function_path: str | None
    custom_generate_function_path: str | None
    # DAPO: dynamic sampling, partial rollout, overlong penalty
    dynamic_sampling_filter_path: str | None
    over_sampling_batch_size: int
    dynamic_sampling_max_rounds: int
    num_steps_per_rollout: int
    partial_rollout: bool
    mask_offpolicy_in_partial_rollout: bool
    overlong_buffer_len: int | None
    overlong_penalty_factor: float
    # debug dumps and evaluation
    save_debug_rollout_data: str | None
    load_debug_rollout_data: str | None
    load_forge_rollout_data: str | None  # slime's forge replay: dumps replayed with engines and sync live
    eval_datasets: tuple[dict, ...]  # one resolved config per eval data set (lichen.config.eval)
    # frozen models served beside the policy (--sglang-config; lichen.engines.clients.frozen_models.FrozenModelSpec)
    frozen_models: tuple = ()
    opd_teacher_served: bool = False  # --use-opd --opd-type sglang: samples get the teacher's log-probs

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RolloutConfig":
        return cls(
            hf_checkpoint=args.hf_checkpoint,
            device=args.device,
            model_options=model_options(args),
            engine_max_batch_size=args.rollout_max_batch_size,
            use_engine_servers=bool(args.rollout_num_engines or args.rollout_external_engine_addrs),
            data=DataConfig.from_args(args),
            sampling=SamplingConfig.from_args(args),
            reward=RewardConfig.from_args(args),
            rollout_function_path=args.rollout_function_path,
            eval_function_path=args.eval_function_path,
            custom_generate_function_path=args.custom_generate_function_path,
            dynamic_sampling_filter_path=args.dynamic_sampling_filter_path,
            over_sampling_batch_size=args.over_sampling_batch_size or args.rollout_batch_size,
            dynamic_sampling_max_rounds=args.dynamic_sampling_max_rounds,
            num_steps_per_rollout=args.num_steps_per_rollout or 1,
            partial_rollout=bool(args.partial_rollout),
            mask_offpolicy_in_partial_rollout=bool(args.mask_offpolicy_in_partial_rollout),
            overlong_buffer_len=args.overlong_buffer_len,
            overlong_penalty_factor=args.overlong_penalty_factor,
            save_debug_rollout_data=args.save_debug_rollout_data,
            load_debug_rollout_data=args.load_debug_rollout_data,
            load_forge_rollout_data=args.load_forge_rollout_data,
            eval_datasets=tuple(args.eval_dataset_configs),
            frozen_models=tuple(getattr(args, "sglang_frozen_models", ())),
            opd_teacher_served=bool(args.use_opd and args.opd_type == "sglang"),
        )


OPD_TEACHER = "teacher"


def opd_teacher_name(frozen: list[str]) -> str:
    """The frozen model of --sglang-config that --opd-type sglang asks: the one named 'teacher', else the only one."""
    if OPD_TEACHER in frozen:
        return OPD_TEACHER
    if len(frozen) == 1:
        return frozen[0]
    have = f"its frozen models are {', '.join(frozen)}" if frozen else "no frozen model is described"
    raise ConfigError(
        f"--opd-type sglang: the teacher is the --sglang-config model named {OPD_TEACHER!r} (update_weights: false), "
        f"or its only frozen model; {have}. Describe the teacher there, or use --opd-type megatron --opd-teacher-load"
    )
