#!/usr/bin/env bash
# GRPO on DAPO-Math-17k with Qwen3-4B on ONE node of 8 GPUs, colocated: 8 FSDP2 trainer ranks and 4 SGLang engines
# (2 GPUs each) on the same 8 placement bundles, taking turns (--colocate turns on --offload-train and
# --offload-rollout, as in slime). Laid out as slime's scripts/run-qwen3-4B.sh: a Ray head on this node, then the
# run submitted as a Ray job; the argument groups carry slime's names.
#
# STATUS: NOT YET RUN ON A GPU. Every flag is checked by `lichen train --dry-run` (DRY_RUN=1 on any machine: no Ray,
# no GPU, no model download needed, only MODEL_DIR's config.json and the data file), and the pieces are tested on
# CPU (docs/runtimes.md, "What a GPU is needed for"). Remove this notice once it has run, with the GPU model, the
# time per step and the peak memory per phase (the trace: --output-dir/trace.json).
#
# Needs on the node: 8 NVIDIA GPUs; `pip install 'lichen[ray,gpu]' "sglang[all]"` (torch_memory_saver is the gpu
# extra: the trainer ranks pause their memory with it while the engines generate); the model and data below.
#
#   MODEL_DIR=/root/Qwen3-4B DATA=/root/dapo-math-17k/dapo-math-17k.jsonl bash examples/ray_gpu_qwen3_8gpus.sh
#   RAY_ADDRESS=http://HEAD:8265 bash examples/ray_gpu_qwen3_8gpus.sh     # submit to a head already running
#   DRY_RUN=1 DEVICE=cpu MODEL_DIR=... DATA=... EVAL_DATA=... bash examples/ray_gpu_qwen3_8gpus.sh
#                                                   # print the resolved configuration only, on any machine
set -euo pipefail

MODEL_DIR=${MODEL_DIR:-/root/Qwen3-4B}              # an HF checkpoint directory (lichen and SGLang read it)
DATA=${DATA:-/root/dapo-math-17k/dapo-math-17k.jsonl}
EVAL_DATA=${EVAL_DATA:-/root/aime-2024/aime-2024.jsonl}
WORK=${WORK:-/root/lichen_qwen3_4b}
LICHEN=${LICHEN:-lichen}

CKPT_ARGS=(
  --hf-checkpoint "$MODEL_DIR"
  --load "$WORK/ckpt" --save "$WORK/ckpt" --save-interval 20   # sharded (torch.distributed.checkpoint) + hf/
)

ROLLOUT_ARGS=(
  --prompt-data "$DATA" --input-key prompt --label-key label --apply-chat-template --rollout-shuffle
  --rm-type deepscaler
  --num-rollout 3000 --rollout-batch-size 32 --n-samples-per-prompt 8
  --rollout-max-response-len 8192 --rollout-temperature 0.8
  --global-batch-size 256
)

EVAL_ARGS=(
  --eval-interval 20 --eval-prompt-data aime "$EVAL_DATA" --n-samples-per-eval-prompt 16
  --eval-max-response-len 16384 --eval-top-p 0.7
)

PERF_ARGS=(
  --bf16 --gradient-checkpointing
  --use-dynamic-batch-size --max-tokens-per-gpu 9216
)

GRPO_ARGS=(
  --advantage-estimator grpo
  --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl
  --entropy-coef 0.00 --eps-clip 0.2 --eps-clip-high 0.28
)

OPTIMIZER_ARGS=(
  --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
)

SGLANG_ARGS=(
  --rollout-engine-backend sglang --rollout-num-gpus-per-engine 2
  --sglang-mem-fraction-static 0.7
)

RAY_ARGS=(
  --runtime ray --actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate   # --rollout-num-gpus: the same 8
  --device "${DEVICE:-cuda}"                          # DEVICE=cpu only for a dry run on a machine without CUDA
  # colocated, the trainer's rank 0 and an engine share a GPU, which one NCCL group refuses; CUDA IPC (slime's
  # colocated path) is not built yet, so the weights go through this node's disk (checked visible at start)
  --update-weight-transport disk --update-weight-mode full --update-weight-disk-dir "$WORK/weights"
)

ARGS=("${RAY_ARGS[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${EVAL_ARGS[@]}" "${PERF_ARGS[@]}"
      "${GRPO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" "${SGLANG_ARGS[@]}" --output-dir "$WORK/run" --use-tensorboard)

if [ "${DRY_RUN:-0}" = "1" ]; then
  exec "$LICHEN" train "${ARGS[@]}" --dry-run
fi

mkdir -p "$WORK"
if [ -z "${RAY_ADDRESS:-}" ]; then
  # the head of this one-node cluster; its dashboard (the job server) on this host only
  ray start --head --node-ip-address "${MASTER_ADDR:-127.0.0.1}" --num-gpus 8 --disable-usage-stats \
    --dashboard-host 127.0.0.1 --dashboard-port 8265
  RAY_ADDRESS=http://127.0.0.1:8265
fi

# PYTHONUNBUFFERED: the job's log shows each step line as it is printed
ray job submit --address "$RAY_ADDRESS" \
  --runtime-env-json '{"env_vars": {"PYTHONUNBUFFERED": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}}' \
  -- "$LICHEN" train "${ARGS[@]}"
