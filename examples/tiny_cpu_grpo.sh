#!/usr/bin/env bash
# Tiny-model RL on a laptop CPU: build a 138k-parameter model, SFT-warm it on two-digit addition, then run GRPO
# and watch greedy accuracy on 500 held-out problems rise. About 3 minutes on 2 cores, no GPU, no downloads.
# examples/quickstart.py is the same run driven from Python (it also prints a summary); this is the version you
# would type yourself.
#
#   bash examples/tiny_cpu_grpo.sh                 # seed 1, everything under runs/tiny_cpu_grpo
#   SEED=2 WORK=runs/seed2 bash examples/tiny_cpu_grpo.sh
#
# Measured with the settings below (seeds 1-3): held-out accuracy 56-71% after SFT, 86-92% after GRPO
# (+19.4 to +29.4 points), about 90 s per seed on 2 cores; see docs/quickstart.md.
set -euo pipefail

SEED=${SEED:-1}
WORK=${WORK:-runs/tiny_cpu_grpo}
LICHEN=${LICHEN:-.venv/bin/lichen}
PYTHON=${PYTHON:-.venv/bin/python}
# One thread per process: the matrices are tiny, and a second spinning thread only hurts when the cores are shared.
export OMP_NUM_THREADS=1
rm -rf "$WORK/sft" "$WORK/rl"   # metrics.jsonl is appended to: start each run clean
mkdir -p "$WORK"

# 1. A random-init llama-style model with a character tokenizer (one token per character, EOS <|endoftext|>).
#    Width 64, 2 layers, 4 heads, MLP 256. The same arguments always give byte-identical files.
"$LICHEN" make-tiny-model "$WORK/model" --arch llama --hidden-size 64 --num-layers 2 --num-heads 4 \
  --intermediate-size 256 --seed "$SEED"

# 2. Data: every a+b with 0 <= a, b <= 99, shuffled; 500 held out for evaluation, 9,500 for training.
#    One JSON object per line: {"prompt": "37+58=", "label": "95"}.
"$PYTHON" - "$WORK" "$SEED" <<'EOF'
import json, random, sys
work, seed = sys.argv[1], int(sys.argv[2])
pairs = [(a, b) for a in range(100) for b in range(100)]
random.Random(seed).shuffle(pairs)
for name, rows in (("heldout", pairs[:500]), ("train", pairs[500:])):
    with open(f"{work}/{name}.jsonl", "w") as f:
        for a, b in rows:
            f.write(json.dumps({"prompt": f"{a}+{b}=", "label": str(a + b)}) + "\n")
EOF

# Flags both stages share.
COMMON=(
  --device cpu --num-threads 1 --seed "$SEED"
  --prompt-data "$WORK/train.jsonl"
  --rollout-shuffle --rollout-seed "$SEED"          # reshuffle the prompts every epoch
  --rm-type leading_number                          # reward 1 iff the answer's leading integer == int(label)
  --eval-prompt-data heldout "$WORK/heldout.jsonl"  # logged as eval/heldout/reward_mean = held-out accuracy
  --eval-temperature 0                              # greedy decoding for evaluation
  --eval-max-response-len 5                         # "198" + EOS is 4 tokens
  --no-progress
)

# 3. SFT warm-up through the same loop: the "rollout" returns the label as the response (+ EOS) and the loss is
#    its negative log-likelihood. 1,000 steps of 64 problems leave the model partly right (50-78% held-out),
#    which is where RL helps most: from the ~10% plateau before that, GRPO gains only a few points.
"$LICHEN" train --hf-checkpoint "$WORK/model" "${COMMON[@]}" \
  --loss-type sft_loss \
  --rollout-function-path lichen.rollout.sft.generate_rollout \
  --disable-rewards-normalization \
  --rollout-batch-size 64 --n-samples-per-prompt 1 \
  --micro-batch-size 64 \
  --num-rollout 1000 \
  --lr 1e-3 \
  --eval-interval 100 \
  --save "$WORK/sft/checkpoints" --save-interval 1000 \
  --output-dir "$WORK/sft"
# (--disable-rewards-normalization: SFT has no rewards; group normalization would reject a group size of 1.
#  --lr 3e-3 left most seeds stuck near 10% for 1,000+ steps. Every save also exports a Hugging Face checkpoint
#  to <save>/iter_<rollout_id:07d>/hf, which is what the GRPO stage starts from.)

LAST=$(cat "$WORK/sft/checkpoints/latest_checkpointed_iteration.txt")   # rollout id of the last save: 999
SFT_CKPT="$WORK/sft/checkpoints/iter_$(printf %07d "$LAST")/hf"

# 4. GRPO from the SFT checkpoint. Each step: 64 prompts x 8 samples at temperature 1, reward 1/0, advantage =
#    (reward - group mean) / group std, one PPO-clipped optimizer step on all 512 samples. The eval before the
#    first step is the SFT model's accuracy; then every 25 steps.
"$LICHEN" train --hf-checkpoint "$SFT_CKPT" "${COMMON[@]}" \
  --advantage-estimator grpo \
  --rollout-batch-size 64 \
  --n-samples-per-prompt 8 \
  --micro-batch-size 512 \
  --rollout-temperature 1.0 \
  --rollout-max-response-len 5 \
  --eps-clip 0.2 \
  --num-rollout 150 \
  --lr 1e-4 --lr-decay-style cosine \
  --eval-interval 25 \
  --output-dir "$WORK/rl"
# (--lr 3e-4 and 1e-3 gained less than 1e-4; the cosine decay to 0 keeps the last eval from landing on a dip.)

# 5. Held-out accuracy before and after RL, from the metrics the run logged.
"$PYTHON" - "$WORK/rl/metrics.jsonl" <<'EOF'
import json, sys
evals = [(r["step"], r["eval/heldout/reward_mean"]) for r in map(json.loads, open(sys.argv[1]))
         if r.get("eval/heldout/reward_mean") is not None]
(_, before), (steps, after) = evals[0], evals[-1]
print(f"held-out accuracy: {100 * before:.1f}% after SFT -> {100 * after:.1f}% after {steps} GRPO steps "
      f"({100 * (after - before):+.1f} points)")
EOF
