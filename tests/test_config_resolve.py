"""Derived values of `lichen train` flags: defaults, batch arithmetic, placement, debug, algo and eval fallbacks."""

from __future__ import annotations

import argparse
import re

import pytest

from lichen.config import build_train_parser, parse_train_args


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    (tmp_path / "eval.jsonl").write_text('{"prompt": "2+2=", "label": "4"}\n')
    return tmp_path


def parse(*extra: str, rbs: int = 4, n: int = 2, base: bool = True) -> argparse.Namespace:
    argv = ["--hf-checkpoint", "hf", "--rollout-batch-size", str(rbs), "--n-samples-per-prompt", str(n)]
    if base:
        argv += ["--prompt-data", "prompts.jsonl", "--rm-type", "math", "--num-rollout", "2"]
    return parse_train_args(argv + list(extra))


# The documented defaults are a contract other modules read by dest name.
DEFAULTS = {
    "seed": 1234,
    "runtime": "local",
    "train_backend": "torch",
    "qwen_gdn_backend": None,
    "model_impl": "auto",
    "trust_remote_code": False,
    "train_env_vars": {},
    "ref_load": None,
    "device": "auto",
    "bf16": False,
    "gradient_checkpointing": False,
    "num_threads": None,
    "dry_run": False,
    "config": None,
    "input_key": "prompt",
    "label_key": "label",
    "metadata_key": "metadata",
    "tool_key": None,
    "apply_chat_template": False,
    "rollout_shuffle": False,
    "rollout_seed": 42,
    "rollout_max_context_len": 4095,
    "rollout_max_prompt_len": 4094,
    "max_prompt_chars": 32 * 4094,
    "max_row_bytes": 32 << 20,
    "skip_bad_rows": False,  # 4096 positions
    "rollout_max_response_len": 1024,
    "rollout_temperature": 1.0,
    "rollout_top_p": 1.0,
    "rollout_top_k": -1,
    "rollout_stop_token_ids": None,
    "custom_rm_path": None,
    "reward_key": None,
    "rollout_function_path": None,
    "eval_function_path": None,
    "custom_generate_function_path": None,
    "tool_paths": None,
    "max_turns": 8,
    "tool_timeout": 30.0,
    "tool_call_parser": "hermes",
    "check_token_fidelity": False,
    "agent_function_path": None,
    "rollout_num_engines": None,
    "rollout_external_engine_addrs": None,
    "sglang_server_concurrency": 512,
    "sglang_router_ip": None,
    "sglang_router_port": None,
    "rollout_max_batch_size": None,
    "sglang_passthrough": [],
    "num_epoch": None,
    "micro_batch_size": 1,
    "use_dynamic_batch_size": False,
    "max_tokens_per_gpu": None,
    "disable_zero_advantage_skip": False,
    "disable_prompt_sharing": False,
    "log_probs_chunk_size": 512,
    "lr": 1e-6,
    "min_lr": 0.0,
    "lr_decay_style": "constant",
    "lr_warmup_iters": 0,
    "lr_decay_iters": None,
    "weight_decay": 0.0,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_eps": 1e-8,
    "clip_grad": 1.0,
    "loss_type": "policy_loss",
    "custom_loss_function_path": None,
    "force_recompute_old_log_probs": False,
    "use_rollout_logprobs": False,
    "moe_aux_loss_coeff": 0.0,
    "advantage_estimator": "grpo",
    "disable_rewards_normalization": False,
    "disable_grpo_std_normalization": False,
    "normalize_advantages": False,
    "eps_clip": 0.2,
    "eps_clip_high": 0.2,
    "eps_clip_c": None,
    "use_opsm": False,
    "opsm_delta": 1e-4,
    "entropy_coef": 0.0,
    "use_kl_loss": False,
    "kl_loss_coef": 0.0,
    "kl_loss_type": "k1",
    "use_unbiased_kl": False,
    "kl_coef": 0.0,
    "gamma": 1.0,
    "lambd": 1.0,
    "loss_agg_mode": "seq-mean-token-mean",
    "calculate_per_token_loss": False,
    "use_tis": False,
    "tis_clip": 2.0,
    "tis_clip_low": 0.0,
    "tis_mode": "truncate",
    "custom_tis_function_path": None,
    "custom_advantage_function_path": None,
    "custom_pg_loss_reducer_function_path": None,
    "use_opd": False,
    "opd_kl_coef": 1.0,
    "opd_type": None,
    "opd_teacher_load": None,
    "save_debug_train_data": None,
    "critic_load": None,
    "critic_lr": None,
    "value_clip": 0.2,
    "num_critic_only_steps": 0,
    "dynamic_sampling_filter_path": None,
    "over_sampling_batch_size": None,
    "dynamic_sampling_max_rounds": 10,
    "partial_rollout": False,
    "mask_offpolicy_in_partial_rollout": False,
    "overlong_buffer_len": None,
    "overlong_penalty_factor": 1.0,
    "reward_concurrency": 16,
    "reward_timeout": 60.0,
    "max_consecutive_failed_steps": 3,
    "rm_api_key_file": None,
    "group_rm": False,
    "rm_url": None,
    "rm_max_retries": 3,
    "rm_retry_backoff": 0.5,
    "code_timeout": 5.0,
    "code_memory_mb": 1024,
    "code_max_procs": 32,
    "code_max_file_mb": 16,
    "code_sandbox_python": None,
    "code_sandbox_uid_base": 2100000000,
    "eval_config": None,
    "eval_reward_key": None,
    "eval_dataset_configs": [],
    "rollout_external_engine_api_key_file": None,
    "rollout_external_engine_admin_api_key_file": None,
    "rollout_engine_backend": "lichen",
    "rollout_num_gpus_per_engine": 1,
    "use_fault_tolerance": False,
    "rollout_health_check_interval": None,
    "rollout_health_check_timeout": None,
    "rollout_health_check_first_wait": None,
    "colocate": False,
    "offload": False,
    "offload_train": False,
    "offload_rollout": False,
    "update_weight_mode": "full",
    "update_weight_transport": "nccl",
    "update_weight_disk_dir": None,
    "update_weight_local_checkpoint_dir": None,
    "update_weight_buffer_size": 512 * 1024 * 1024,
    "update_weight_disk_keep_files": False,
    "update_weight_full_interval": None,
    "update_weight_delta_encoding": "xor",
    "update_weight_delta_checksum": "xxh3-128",
    "check_weight_update_equal": False,
    "custom_update_weight_post_write_path": None,
    "async_train": False,
    "update_weights_interval": 1,
    "fully_async": False,
    "max_staleness": None,
    "max_staleness_action": "drop",
    "debug_rollout_only": False,
    "debug_train_only": False,
    "save_debug_rollout_data": None,
    "load_debug_rollout_data": None,
    "save": None,
    "load": None,
    "save_interval": None,
    "eval_prompt_data": None,
    "eval_datasets": [],
    "eval_interval": None,
    "skip_eval_before_train": False,
    "n_samples_per_eval_prompt": 1,
    "eval_temperature": 1.0,
    "eval_top_p": 1.0,
    "eval_max_response_len": 1024,
    "eval_rm_type": "math",
    "use_tensorboard": False,
    "use_wandb": False,
    "wandb_mode": "online",
    "wandb_project": "lichen",
    "wandb_run_name": None,
    "wandb_group": None,
    "wandb_key": None,
    "no_progress": False,
    "log_samples": 8,
    "trace": False,
    "watchdog_timeout": 3600.0,
    "watchdog_wait": False,
    "ray_address": None,
    "actor_num_nodes": None,
    "actor_num_gpus_per_node": None,
    "rollout_num_gpus": None,
    "use_lora": False,
    "lora_rank": 64,
    "lora_alpha": 128.0,
    "lora_dropout": 0.0,
    "lora_bias": "none",
    "lora_target_preset": None,
    "lora_target_modules": None,
    "lora_exclude_modules": None,
    "lora_learning_rate": None,
    "lora_weight_decay": 0.0,
    "lora_load": None,
    "save_lora": None,
    "lora_rollout_sync_mode": "merged",
    "lora_save_merged_hf": None,
    # slime's 2026 features (docs/slime-compat.md)
    "balance_by_flops": False,
    "ci_train_rollout_logprob_abs_diff_threshold": None,
    "freeze_params_name_list": None,
    "only_train_params_name_list": None,
    "load_forge_rollout_data": None,
    "no_save_optim": False,
    "reset_optimizer_states": False,
    "optimizer_cpu_offload": False,
    "lr_warmup_fraction": None,
    "rollout_sample_hook_path": [],
    "save_hf": None,
    "sglang_config": None,
    "sglang_frozen_models": (),
    # engines, vLLM and fault tolerance (docs/engines.md, docs/fault-tolerance.md)
    "vllm_python": None,
    "rollout_max_failed_restarts": None,
    "min_healthy_engines": None,
    "max_trainer_restarts": None,
    "async_save": True,
}


def test_defaults(files):
    args = parse()
    got = {key: getattr(args, key) for key in DEFAULTS}
    assert got == DEFAULTS
    assert (args.rollout_batch_size, args.n_samples_per_prompt, args.num_rollout) == (4, 2, 2)
    assert re.fullmatch(r"runs/\d{8}-\d{6}", args.output_dir)


def test_every_flag_dest_is_covered_by_the_tests(files):
    args = parse()
    public = {k for k in vars(args) if not k.startswith("_")}
    given = {
        "hf_checkpoint",
        "prompt_data",
        "rm_type",
        "rollout_batch_size",
        "n_samples_per_prompt",
        "num_rollout",
        "output_dir",
        "global_batch_size",
        "num_steps_per_rollout",
    }
    assert public == set(DEFAULTS) | given


@pytest.mark.parametrize(
    "rbs, n, extra, gbs, steps",
    [
        (4, 2, [], 8, 1),  # one optimizer step of all 4 x 2 samples
        (4, 2, ["--global-batch-size", "2"], 2, 4),  # 8 / 2 = 4 steps
        (4, 2, ["--num-steps-per-rollout", "4"], 2, 4),  # 8 / 4 = 2 samples per step
        (4, 2, ["--global-batch-size", "4", "--num-steps-per-rollout", "2"], 4, 2),  # agree: 4 x 2 = 8
        (6, 4, ["--num-steps-per-rollout", "3"], 8, 3),  # 24 / 3
        (6, 4, ["--global-batch-size", "12"], 12, 2),  # 24 / 12
        (3, 1, ["--global-batch-size", "3", "--disable-rewards-normalization"], 3, 1),
    ],
)
def test_batch_arithmetic(files, rbs, n, extra, gbs, steps):
    args = parse(*extra, rbs=rbs, n=n)
    assert (args.global_batch_size, args.num_steps_per_rollout) == (gbs, steps)
    assert args.global_batch_size * args.num_steps_per_rollout == rbs * n


def test_micro_batch_divisibility_is_skipped_with_dynamic_batching(files):
    args = parse("--micro-batch-size", "3", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096")
    assert args.max_tokens_per_gpu == 4096 and args.global_batch_size == 8


@pytest.mark.parametrize(
    "extra, train, rollout",
    [
        ([], False, False),
        (["--colocate"], True, True),
        (["--offload"], True, True),
        (["--colocate", "--no-offload-train"], False, True),
        (["--colocate", "--no-offload-rollout"], True, False),
        (["--offload-rollout"], False, True),
        (["--offload-train"], True, False),
        (["--offload", "--no-offload-rollout"], True, True),  # --offload wins, as in slime
    ],
)
def test_placement_resolution(files, extra, train, rollout):
    args = parse(*extra)
    assert (args.offload_train, args.offload_rollout) == (train, rollout)


def test_debug_rollout_only_turns_placement_off(files):
    args = parse("--debug-rollout-only", "--colocate", "--offload", "--offload-train")
    assert (args.colocate, args.offload_train, args.offload_rollout) == (False, False, False)


def test_load_debug_data_implies_train_only_and_needs_no_data_or_reward(files):
    argv = [
        "--hf-checkpoint",
        "hf",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "2",
        "--num-rollout",
        "3",
        "--load-debug-rollout-data",
        "dumps/{rollout_id}.pt",
    ]
    args = parse_train_args(argv)
    assert args.debug_train_only is True
    assert args.prompt_data is None and args.rm_type is None and args.custom_rm_path is None


def test_eps_clip_high_follows_eps_clip_unless_given(files):
    assert parse("--eps-clip", "0.3").eps_clip_high == 0.3
    assert parse("--eps-clip", "0.3", "--eps-clip-high", "0.28").eps_clip_high == 0.28


@pytest.mark.parametrize(
    "extra", [["--calculate-per-token-loss"], ["--calculate-per-token-loss", "--loss-agg-mode", "token-mean"]]
)
def test_per_token_loss_alias(files, extra):
    assert parse(*extra).loss_agg_mode == "token-mean"


def test_kl_loss_with_use_flag_is_accepted(files):
    args = parse("--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-loss-type", "low_var_kl")
    assert (args.use_kl_loss, args.kl_loss_coef, args.kl_loss_type) == (True, 0.01, "low_var_kl")


def test_eval_fallbacks_and_datasets(files):
    args = parse(
        "--rollout-temperature",
        "0.7",
        "--rollout-top-p",
        "0.9",
        "--rollout-max-response-len",
        "64",
        "--eval-prompt-data",
        "a",
        "eval.jsonl",
        "b",
        "eval.jsonl@[:1]",
        "--eval-interval",
        "5",
    )
    assert args.eval_datasets == [("a", "eval.jsonl"), ("b", "eval.jsonl@[:1]")]
    assert (args.eval_temperature, args.eval_top_p, args.eval_max_response_len) == (0.7, 0.9, 64)
    assert args.eval_rm_type == "math"
    greedy = parse(
        "--eval-temperature", "0", "--eval-top-p", "0.5", "--eval-max-response-len", "8", "--eval-rm-type", "exact"
    )
    assert (greedy.eval_temperature, greedy.eval_top_p, greedy.eval_max_response_len) == (0.0, 0.5, 8)
    assert greedy.eval_rm_type == "exact"


def test_load_same_as_save_may_not_exist_yet(files):
    args = parse("--save", "ckpt", "--load", "./ckpt", "--save-interval", "2")
    assert (args.save, args.load, args.save_interval) == ("ckpt", "./ckpt", 2)
    (files / "old").mkdir()
    assert parse("--load", "old").load == "old"  # exists, maybe without a checkpoint: starts fresh


def test_custom_reward_and_plugins_resolve(files):
    args = parse_train_args(
        [
            "--hf-checkpoint",
            "hf",
            "--prompt-data",
            "prompts.jsonl",
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "2",
            "--num-epoch",
            "3",
            "--custom-rm-path",
            "os.path.join",
            "--rollout-function-path",
            "os.path.join",
        ]
    )
    assert (args.custom_rm_path, args.rm_type, args.num_epoch, args.num_rollout) == ("os.path.join", None, 3, None)
    assert args.eval_rm_type is None


def test_env_vars_parsed_and_output_dir_kept(files):
    args = parse("--train-env-vars", '{"OMP_NUM_THREADS": "2", "X": ""}', "--output-dir", "out")
    assert args.train_env_vars == {"OMP_NUM_THREADS": "2", "X": ""}
    assert args.output_dir == "out"


def test_every_flag_has_help_and_snake_case_dest():
    parser = build_train_parser()
    for action in parser._actions:
        assert action.help and action.help.strip(), action.option_strings
        long = [s for s in action.option_strings if s.startswith("--")][0]
        assert action.dest == long[2:].replace("-", "_"), long
    rendered = parser.format_help()  # also checks every help string formats (no stray % signs)
    assert "--train-env-vars" in rendered and "(default: 1234)" in rendered
