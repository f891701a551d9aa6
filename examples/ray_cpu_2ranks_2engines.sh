#!/usr/bin/env bash
# --runtime ray on one CPU machine: 2 trainer ranks (FSDP2 over gloo) + 2 lichen serve engines, each a Ray actor on
# its own placement bundle. lichen starts a local Ray instance (declaring 4 GPUs for the 4 bundles: Ray numbers them
# and sets CUDA_VISIBLE_DEVICES, CPU torch ignores it) and stops it at the end. Needs `pip install 'lichen[ray]'`.
#
#   bash examples/ray_cpu_2ranks_2engines.sh                 # everything under runs/ray_cpu
#   RAY_ADDRESS=127.0.0.1:6379 bash examples/ray_cpu_2ranks_2engines.sh   # join a running Ray instead
#
# The same flags under `ray job submit --address http://HEAD:8265 -- lichen train ...` run as a Ray job.
set -euo pipefail

WORK=${WORK:-runs/ray_cpu}
LICHEN=${LICHEN:-.venv/bin/lichen}
PYTHON=${PYTHON:-.venv/bin/python}
export OMP_NUM_THREADS=1
rm -rf "$WORK/out" "$WORK/checkpoints"
mkdir -p "$WORK"

"$LICHEN" make-tiny-model "$WORK/model" --arch llama --hidden-size 64 --num-layers 2 --num-heads 4 \
  --intermediate-size 128 --seed 0
"$PYTHON" - "$WORK" <<'PY'
import json, random, sys
rng = random.Random(0)
with open(f"{sys.argv[1]}/train.jsonl", "w") as f:
    for _ in range(256):
        a, b = rng.randrange(100), rng.randrange(100)
        f.write(json.dumps({"prompt": f"{a}+{b}=", "label": str(a + b)}) + "\n")
PY
# A reward that varies across a random model's samples (the fraction of digits in the response), so the 3 steps
# train on something; a real run uses --rm-type (e.g. leading_number) on a warmed-up model.
cat > "$WORK/digits_reward.py" <<'PY'
def digit_fraction(args, sample) -> float:
    return sum(c.isdigit() for c in sample.response) / max(len(sample.response), 1)
PY
export PYTHONPATH="$WORK${PYTHONPATH:+:$PYTHONPATH}"

"$LICHEN" train --runtime ray \
  --actor-num-nodes 1 --actor-num-gpus-per-node 2 \
  --rollout-num-gpus 2 --rollout-num-gpus-per-engine 1 \
  --hf-checkpoint "$WORK/model" --prompt-data "$WORK/train.jsonl" --custom-rm-path digits_reward.digit_fraction \
  --device cpu --num-threads 1 \
  --advantage-estimator grpo --rollout-batch-size 4 --n-samples-per-prompt 4 --rollout-max-response-len 5 \
  --micro-batch-size 8 --lr 1e-3 --num-rollout 3 \
  --save "$WORK/checkpoints" --output-dir "$WORK/out" --no-progress
