"""Rows for the flags of slime's own parser that lichen does not define: data only, merged into
`slime_flags.SLIME_FLAGS`.

slime's parser (slime/utils/arguments.py, its SGLang and Megatron-server argument files) defines flags beyond
those a launch script usually sets. Each one lichen does not define has a row here, so a script using any of them
learns in one run what lichen does with it. tests/test_slime_parser_flags.py checks every flag of a pinned slime
commit (tests/fixtures/slime_flags_624b824a.txt) resolves to one class with a reason.
"""

from __future__ import annotations

from lichen.config.slime.flags_data import (
    MAPPED,
    NA_NO_EFFECT,
    NA_SHARDING,
    NOT_YET,
    FlagRule,
    rules,
)

_LOGGING = "slime's extra logging or profiling output; what is trained is the same"
_PLUGIN = "a slime plug-in hook lichen does not call yet; running without it would silently change the run"
_TEACHER_SERVER = (
    "a setting of slime's Megatron teacher server (OPD with --opd-type megatron); lichen scores the teacher "
    "inside the trainer (--use-opd --opd-teacher-load), so there is no server to set"
)

SLIME_PARSER_FLAGS: dict[str, FlagRule] = {
    **rules(NA_NO_EFFECT, "ignored", _LOGGING, "--log-correct-samples", "--log-multi-turn", "--log-passrate"),
    **rules(NA_NO_EFFECT, "ignored", _LOGGING, "--log-reward-category", "--wandb-always-use-train-step"),
    **rules(NA_NO_EFFECT, "ignored", _LOGGING, "--memory-recorder", "--memory-snapshot-dir"),
    **rules(NA_NO_EFFECT, "ignored", _LOGGING, "--memory-snapshot-num-steps", "--record-memory-history"),
    **rules(NA_NO_EFFECT, "ignored", _LOGGING, "--profile-target", "--disable-wandb-random-suffix", "--wandb-dir"),
    **rules(
        NA_NO_EFFECT,
        "--use-tensorboard writes under --output-dir",
        "where slime writes TensorBoard files; the logged values are the same",
        "--tb-project-name",
        "--tb-experiment-name",
    ),
    **rules(
        NA_NO_EFFECT,
        "model_type of config.json",
        "names the Megatron->HF weight conversion; lichen loads HF weights directly",
        "--model-name",
    ),
    **rules(
        NA_NO_EFFECT,
        "lichen's in-process data path",
        "how slime moves rollout tensors between Ray actors; the data are the same",
        "--rollout-data-transport",
        "--use-distributed-post",
    ),
    **rules(
        NA_NO_EFFECT,
        "engines run prefill and decode together",
        "SGLang prefill/decode disaggregation is a serving layout; the tokens are the same",
        "--prefill-num-servers",
    ),
    **rules(
        NA_NO_EFFECT,
        "config.json's vocabulary size",
        "Megatron pads the embedding for its tensor parallelism; the padded rows are never used",
        "--padded-vocab-size",
    ),
    **rules(
        NA_NO_EFFECT,
        "ignored",
        "a Megatron kernel or safety switch (deterministic kernels, experimental-feature gate, the NaN check of "
        "Megatron's loss); the math is the same",
        "--deterministic-mode",
        "--enable-experimental",
        "--no-check-for-nan-in-loss-and-grad",
    ),
    **rules(
        NA_NO_EFFECT,
        "ignored",
        _TEACHER_SERVER,
        "--teacher-port",
        "--teacher-warmup-port",
        "--teacher-warmup-timeout-s",
        "--teacher-sample-reduction-chunk-size",
        "--teacher-label-reduction-chunk-size",
        "--megatron-server-max-length",
        "--megatron-server-update-timeout-s",
        "--megatron-server-warmup",
        "--no-megatron-server-warmup",
    ),
    **rules(
        NA_SHARDING,
        "FSDP2 over all trainer ranks; log-probs in --max-tokens-per-gpu micro-batches",
        "memory layout only (context-parallel gathers, chunking, padding, loss recompute); the numbers do not change",
        "--allgather-cp",
        "--log-probs-max-tokens-per-gpu",
        "--data-pad-size-multiplier",
        "--recompute-loss-function",
    ),
    **rules(
        NA_SHARDING,
        "--offload-train",
        "slime frees the training actors' memory during rollout by recreating them; lichen offloads instead",
        "--release-train",
    ),
    **rules(
        MAPPED,
        "train/train_rollout_logprob_abs_diff, logged every step",
        "slime computes its train/rollout mismatch metrics on request; lichen always logs the log-prob mismatch",
        "--get-mismatch-metrics",
    ),
    **rules(
        MAPPED,
        "no advantages: --loss-type sft_loss / custom_loss compute none",
        "slime's switch for SFT and custom losses; lichen computes advantages only for --loss-type policy_loss",
        "--disable-compute-advantages-and-returns",
    ),
    **rules(
        MAPPED,
        "--check-weight-update-equal --ci-train-rollout-logprob-abs-diff-threshold 0.1 (slime's default, unless "
        "the script gives it)",
        "slime's CI assertions (tests/ of slime): engine weight versions after sync, first-step KL ~ 0, log-prob "
        "and entropy bounds, train/rollout log-prob diff <= --ci-train-rollout-logprob-abs-diff-threshold; lichen "
        "runs its sync equality check and stops the run past the log-prob bound, the other metric assertions are "
        "lichen's test suite's",
        "--ci-test",
    ),
    **rules(
        NA_NO_EFFECT,
        "ignored (lichen's test suite holds its CI checks)",
        "a setting of slime's CI assertions (--ci-test); the training is the same",
        "--ci-disable-kl-checker",
        "--ci-save-grad-norm",
        "--ci-load-grad-norm",
    ),
    **rules(
        NOT_YET,
        "leave it out (the default only)",
        _PLUGIN,
        "--buffer-filter-path",
        "--custom-config-path",
        "--custom-convert-samples-to-train-data-path",
        "--custom-eval-rollout-log-function-path",
        "--custom-rollout-log-function-path",
        "--custom-reward-post-process-path",
        "--data-source-path",
        "--rollout-all-samples-process-path",
        "--rollout-data-postprocess-path",
        "--rollout-sample-filter-path",
    ),
    **rules(
        NOT_YET,
        "a plug-in on lichen's model (--custom-loss-function-path, --custom-tis-function-path)",
        "a hook on Megatron's own objects (model provider, init, pre-log-prob / pre-train-step hooks); lichen "
        "trains an HF / torch model",
        "--custom-model-provider-path",
        "--custom-megatron-init-path",
        "--custom-megatron-before-log-prob-hook-path",
        "--custom-megatron-before-train-step-hook-path",
        "--megatron-config-path",
    ),
    **rules(
        NOT_YET,
        "--bf16",
        "Megatron's SGLang-matching block-FP8 DeepGEMM forward; fp8 paths are not built",
        "--megatron-deepgemm-forward-layers",
        "--megatron-deepgemm-forward-modules",
        "--megatron-deepgemm-moe-forward-layers",
        "--megatron-deepgemm-moe-forward-modules",
    ),
    **rules(
        NOT_YET,
        "--freeze-params-name-list with the indexer's parameter names",
        "freezing the DSA indexer by its module names is not built (lichen's models have no DSA indexer)",
        "--freeze-indexer",
    ),
    **rules(
        NOT_YET,
        "lichen's AdamW (its moments are kept across steps)",
        "an optimizer variant lichen does not build yet",
        "--use-stateless-adam",
    ),
    **rules(
        NOT_YET,
        "point --ref-load / --opd-teacher-load / --load at the directory itself",
        "selects an iteration of a Megatron checkpoint directory; lichen loads one HF directory",
        "--ref-ckpt-step",
        "--opd-teacher-ckpt-step",
        "--start-rollout-id",
    ),
    **rules(
        NOT_YET,
        "the same settings per dataset in --eval-config, where lichen has them",
        "eval-only overrides of data keys and sampling that lichen's eval flags do not have",
        "--eval-input-key",
        "--eval-label-key",
        "--eval-tool-key",
        "--eval-top-k",
        "--eval-max-prompt-len",
        "--eval-min-new-tokens",
        "--eval-max-context-len",
    ),
    **rules(
        NOT_YET,
        "lichen's rollout (--rollout-function-path, --fully-async)",
        "slime_plugins' external rollout buffer service",
        "--rollout-buffer-url",
        "--fetch-trajectory-retry-times",
        "--min-batch-collection-ratio",
        "--rollout-task-type",
    ),
    **rules(
        NOT_YET,
        "--rollout-stop-token-ids",
        "stop strings and special-token skipping change the response text; only stop token ids are built",
        "--rollout-stop",
        "--rollout-skip-special-tokens",
    ),
    **rules(
        NOT_YET,
        "--apply-chat-template (the template's defaults)",
        "extra chat-template arguments (enable_thinking, ...) change the prompts and are not passed yet",
        "--apply-chat-template-kwargs",
    ),
    **rules(
        NOT_YET,
        "the data's label as the response (lichen.rollout.sft)",
        "slime's SFT masks all but the assistant turns of a conversation by a per-template rule; not built",
        "--loss-mask-type",
    ),
    **rules(
        NOT_YET,
        "--prompt-data (always the global dataset)",
        "a rollout function that manages its own data is not built",
        "--disable-rollout-global-dataset",
    ),
    **rules(
        NOT_YET,
        "--load-debug-rollout-data (every sample)",
        "subsampling replayed rollout dumps is not built",
        "--load-debug-rollout-data-subsample",
    ),
    **rules(
        NOT_YET,
        "--save-debug-rollout-data / --save-debug-train-data",
        "slime's one-directory dump of every training detail is not built",
        "--dump-details",
    ),
    **rules(
        NOT_YET,
        "the current weights' old log-probs (or --use-rollout-logprobs)",
        "keeping the rollout-time actor for old log-probs is not built",
        "--keep-old-actor",
    ),
    **rules(
        NOT_YET,
        "--entropy-coef (entropy in the loss)",
        "the rollout-time entropy slime keeps for custom loss masks is not built",
        "--use-rollout-entropy",
    ),
    **rules(
        NOT_YET,
        "a fixed --ref-load",
        "refreshing the reference model from the actor every N steps is not built",
        "--ref-update-interval",
    ),
    **rules(
        NOT_YET,
        "the trainer's own MoE routing",
        "MoE routing replay (the rollout's expert choices reused in training) is not built",
        "--use-routing-replay",
        "--use-rollout-routing-replay",
    ),
    **rules(
        NOT_YET,
        "the text tokens of --prompt-data",
        "multimodal inputs are not built",
        "--multimodal-keys",
    ),
    **rules(
        NOT_YET,
        "set HTTPS_PROXY / WANDB_BASE_URL / WANDB_ENTITY / WANDB_RUN_ID in the environment",
        "where slime sends its HTTP traffic or W&B logs; ignoring it would send them elsewhere",
        "--http-proxy",
        "--wandb-host",
        "--wandb-team",
        "--wandb-run-id",
    ),
}
