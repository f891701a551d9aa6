#!/usr/bin/env bash
# GRPO on GSM8K with a real model (Qwen2.5-0.5B-Instruct) and SGLang rollout engines that lichen launches.
#
# STATUS: NOT YET RUN ON A GPU. Every flag below is checked by `lichen train --dry-run` (run with DRY_RUN=1 on any
# machine), and the SGLang command lichen builds is covered by tests/test_sglang_launcher.py, but this script has
# not been run end to end on a GPU yet. Remove this notice once it has, with the GPU model and the time per step.
#
# Needs: one or more NVIDIA GPUs, `pip install "sglang[all]" datasets` in the environment that runs lichen (the
# engines are started with the same Python), network access for the model and data set the first time.
#
# Layout (--runtime local): the trainer runs in this process on GPU 0; lichen launches NUM_ENGINES SGLang servers,
# engine i on GPUs i*TP .. i*TP+TP-1, so engine 0 shares GPU 0 with the trainer (colocated): the SGLang memory
# fraction is kept low enough for the trainer's weights, gradients and Adam state (about 16 bytes per parameter,
# ~8 GB here). Each engine runs
#   python -m sglang.launch_server --model-path MODEL --host 127.0.0.1 --port P --tp-size TP --base-gpu-id i*TP
#       --random-seed 1234 --dtype bfloat16 --mem-fraction-static 0.4 --enable-deterministic-inference
# (the last two from the --sglang-* pass-through below; the engine logs are in $OUT/engines/engine_<i>.log).
# --enable-deterministic-inference makes SGLang honour the per-sample sampling seeds lichen sends, so a request
# re-sent after an engine failure draws the same tokens.
#
#   bash examples/sglang_gpu_grpo.sh                      # 1 engine on 1 GPU
#   NUM_ENGINES=2 TP=2 bash examples/sglang_gpu_grpo.sh   # 2 engines x 2 GPUs
#   DRY_RUN=1 bash examples/sglang_gpu_grpo.sh            # print the resolved configuration only
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
NUM_ENGINES=${NUM_ENGINES:-1}
TP=${TP:-1}
WORK=${WORK:-runs/sglang_gpu_grpo}
OUT=${OUT:-$WORK/run}
PYTHON=${PYTHON:-python}
mkdir -p "$WORK"

# 1. the model as a local HF directory (lichen and SGLang both read it)
MODEL_DIR="$WORK/model"
if [ ! -f "$MODEL_DIR/config.json" ]; then
  "$PYTHON" -c "import sys; from huggingface_hub import snapshot_download; snapshot_download(sys.argv[1], local_dir=sys.argv[2])" \
    "$MODEL" "$MODEL_DIR"
fi

# 2. GSM8K as JSONL: {"prompt": question + instruction, "label": the final number}
if [ ! -f "$WORK/gsm8k_train.jsonl" ]; then
  "$PYTHON" - "$WORK" <<'EOF'
import json, sys
from datasets import load_dataset
out = sys.argv[1]
suffix = "\nLet's think step by step and output the final answer after \"####\"."
for split in ("train", "test"):
    with open(f"{out}/gsm8k_{split}.jsonl", "w") as f:
        for row in load_dataset("openai/gsm8k", "main", split=split):
            label = row["answer"].split("####")[-1].strip().replace(",", "")
            f.write(json.dumps({"prompt": [{"role": "user", "content": row["question"] + suffix}],
                                "label": label}) + "\n")
EOF
fi

# 3. GRPO: 32 prompts x 8 samples per step, weights synced to the engines over the file system every step
ARGS=(
  --hf-checkpoint "$MODEL_DIR" --bf16 --device cuda --output-dir "$OUT"
  --prompt-data "$WORK/gsm8k_train.jsonl" --apply-chat-template --rollout-shuffle
  --rm-type math_lenient                  # the last number (GSM8K answers follow "####", not \boxed)
  --num-rollout 200 --rollout-batch-size 32 --n-samples-per-prompt 8
  --rollout-max-response-len 1024 --rollout-temperature 1.0
  --global-batch-size 256 --micro-batch-size 4 --gradient-checkpointing
  --advantage-estimator grpo --lr 1e-6 --eps-clip 0.2 --eps-clip-high 0.28
  --rollout-num-engines "$NUM_ENGINES" --rollout-engine-backend sglang --rollout-num-gpus-per-engine "$TP"
  --sglang-mem-fraction-static 0.4 --sglang-enable-deterministic-inference
  --update-weight-transport disk --update-weight-disk-dir "$WORK/weights"
  --use-fault-tolerance --rollout-health-check-first-wait 120
  --eval-prompt-data gsm8k "$WORK/gsm8k_test.jsonl" --eval-interval 20 --n-samples-per-eval-prompt 1
  --eval-temperature 0 --save "$OUT/ckpt" --save-interval 50 --use-tensorboard
)
if [ "${DRY_RUN:-0}" = "1" ]; then
  exec "$PYTHON" -m lichen.cli train "${ARGS[@]}" --dry-run
fi
exec "$PYTHON" -m lichen.cli train "${ARGS[@]}"
