#!/usr/bin/env bash
# The tiny CPU run of the quick start, as plain commands: build a model, make addition data, SFT warm-up, GRPO.
# Run from the repository root after `make setup`. About 3-4 minutes on 2 CPU cores.
set -euo pipefail
LICHEN=.venv/bin/lichen
RUN=runs/tiny_cpu_grpo
mkdir -p "$RUN"

# 1. A random-init llama-style model (180k parameters) with a one-token-per-character tokenizer.
$LICHEN make-tiny-model "$RUN/model" --arch llama --hidden-size 64 --num-layers 2 --num-heads 4 \
    --intermediate-size 256 --seed 4

# 2. Data: every a+b with 0 <= a, b <= 99, shuffled; 500 held out for evaluation, the rest for training.
.venv/bin/python - "$RUN" <<'PY'
import json, random, sys
run = sys.argv[1]
pairs = [(a, b) for a in range(100) for b in range(100)]
random.Random(4).shuffle(pairs)
for name, rows in (("heldout", pairs[:500]), ("train", pairs[500:])):
    with open(f"{run}/{name}.jsonl", "w") as f:
        for a, b in rows:
            f.write(json.dumps({"prompt": f"{a}+{b}=", "label": str(a + b)}) + "\n")
PY

COMMON=(
    --num-threads 1                        # tiny matrices: one thread is fastest
    --seed 4
    --rollout-shuffle --rollout-seed 4     # reshuffle the prompts every epoch
    --rm-type leading_number               # reward 1 iff the answer's leading number equals the label
    --eval-prompt-data heldout "$RUN/heldout.jsonl"
    --eval-temperature 0                   # greedy evaluation
    --eval-max-response-len 5
    --no-progress
)

# 3. SFT warm-up: the label is the response; stopped early so RL has room to improve.
$LICHEN train --hf-checkpoint "$RUN/model" --prompt-data "$RUN/train.jsonl" "${COMMON[@]}" \
    --loss-type sft_loss --rollout-function-path lichen.rollout.sft.generate_rollout \
    --rollout-batch-size 64 --n-samples-per-prompt 1 --micro-batch-size 64 \
    --num-rollout 1000 --lr 1e-3 --eval-interval 250 \
    --save "$RUN/sft/checkpoints" --save-interval 1000 --output-dir "$RUN/sft"

# 4. GRPO from the SFT checkpoint: 32 prompts x 8 samples per step, advantages normalized within each group.
$LICHEN train --hf-checkpoint "$RUN/sft/checkpoints/iter_0000999/hf" --prompt-data "$RUN/train.jsonl" "${COMMON[@]}" \
    --advantage-estimator grpo \
    --rollout-batch-size 32 --n-samples-per-prompt 8 --micro-batch-size 256 \
    --rollout-temperature 1.0 --rollout-max-response-len 5 \
    --num-rollout 150 --lr 1e-4 --eval-interval 25 \
    --output-dir "$RUN/rl"
# Held-out accuracy before RL (step 0) and after: grep reward_mean "$RUN/rl/metrics.jsonl"
