#!/usr/bin/env bash
# Runs every path of lichen that only a GPU exercises, on a tiny model, in at most 8 minutes, and prints ONE table
# (check | result | seconds | peak device memory). docs/runtimes.md#what-a-gpu-is-needed-for says what each row
# covers and what was untested before.
#
#   bash scripts/gpu_check.sh             # on a CUDA machine (a fresh clone: it runs scripts/setup.sh ray,gpu)
#   bash scripts/gpu_check.sh --dry-run   # anywhere: prints each check's command and the rows as "planned"
#   WORK=/tmp/gc bash scripts/gpu_check.sh  # where runs, logs and the SGLang venv go (default runs/gpu_check)
#
# Checks (each with its own time cap; one that would start past the 8-minute budget is skipped and says so):
#   setup            use .venv if it imports lichen, else scripts/setup.sh ray; torch_memory_saver (the gpu extra)
#   train_cuda_bf16  lichen train --device cuda --bf16, in-process engine, 3 steps
#   memory_saver     --runtime ray, 1 rank + 1 engine colocated on GPU 0 (--colocate: --offload-train through
#                    torch_memory_saver's preload hook, --offload-rollout), disk sync; per-phase peaks listed below
#                    the table from the run's metrics (torch's counters: a paused region still counts there, the
#                    device-wide column is nvidia-smi's)
#   tensor_ipc       --colocate with one launched `lichen serve` on the same GPU, --update-weight-transport tensor
#                    (CUDA IPC handles from the trainer into the server)
#   nccl_sync        --runtime ray, 1 rank on GPU 0 + 1 engine on GPU 1, --update-weight-transport nccl; skipped
#                    with the reason on fewer than 2 GPUs
#   sglang_engine    `pip install sglang` (capped) into its own venv with lichen, then one SGLang engine launched by
#                    lichen sharing GPU 0 with the trainer, disk sync; skipped with the reason if the install fails
#   packed_attention `lichen bench packed --device cuda --dtype bfloat16`: a train step over packed rows (W2's model
#                    and samples), attention per segment vs one call with the dense mask; its result lines are
#                    printed below the table (the data for deciding whether GPUs should pack rows, which they
#                    do not today)
# "peak device memory" is the highest `nvidia-smi` memory.used of any GPU while the check ran (every process).
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$arg' (only --dry-run)" >&2; exit 2 ;;
  esac
done

WORK=${WORK:-runs/gpu_check}
BUDGET_S=${GPU_CHECK_BUDGET_S:-480}
VENV=${LICHEN_VENV:-.venv}
SGV="$WORK/venv-sglang"
START=$SECONDS
mkdir -p "$WORK/logs"
ROWS=()

row() { ROWS+=("$1|$2|$3|$4"); }   # check, result, seconds, peak
left() { echo $((BUDGET_S - (SECONDS - START))); }

# Peak memory.used (MiB) of any GPU while a command runs: nvidia-smi samples every 200 ms into a file.
SAMPLER_PID=""
sample_start() {
  : > "$WORK/logs/smi.txt"
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$WORK/logs/smi.txt" 2>/dev/null &
    SAMPLER_PID=$!
  fi
}
sample_stop() {
  if [ -n "$SAMPLER_PID" ]; then kill "$SAMPLER_PID" 2>/dev/null; wait "$SAMPLER_PID" 2>/dev/null; fi
  SAMPLER_PID=""
  sort -n "$WORK/logs/smi.txt" 2>/dev/null | tail -1 | awk '{ if ($1 != "") printf "%.2f GiB", $1 / 1024; else print "-" }'
}

# run_check NAME CAP_S CMD...: runs CMD (capped at CAP_S and at what is left of the budget), logs to
# $WORK/logs/NAME.log, adds a row. Dry run: prints the command and a "planned" row.
run_check() {
  local name=$1 cap=$2; shift 2
  if [ "$DRY" = 1 ]; then
    printf 'command[%s]:' "$name"; printf ' %q' "$@"; printf '\n'
    row "$name" planned - -
    return 0
  fi
  local budget; budget=$(left)
  if [ "$budget" -lt 20 ]; then row "$name" "skipped: the ${BUDGET_S}s budget is spent" 0 -; return 1; fi
  [ "$cap" -gt "$budget" ] && cap=$budget
  local t0=$SECONDS rc peak
  sample_start
  timeout --kill-after=10 "$cap" "$@" > "$WORK/logs/$name.log" 2>&1
  rc=$?
  peak=$(sample_stop)
  if [ "$rc" = 0 ]; then
    row "$name" ok $((SECONDS - t0)) "$peak"
  elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    row "$name" "FAIL: over its ${cap}s cap (logs/$name.log)" $((SECONDS - t0)) "$peak"
  else
    row "$name" "FAIL rc=$rc: $(grep -v '^\s*$' "$WORK/logs/$name.log" | tail -1 | cut -c1-90)" $((SECONDS - t0)) "$peak"
  fi
  return "$rc"
}

# --- setup -------------------------------------------------------------------------------------------------------
PY="$VENV/bin/python"
LICHEN="$VENV/bin/lichen"
if [ "$DRY" = 1 ]; then
  if "$PY" -c "import lichen" >/dev/null 2>&1; then
    row setup "planned (uses $VENV)" - -
  else
    echo "command[setup]: bash scripts/setup.sh ray,gpu"
    row setup planned - -
  fi
else
  t0=$SECONDS
  if ! "$PY" -c "import lichen, ray" >/dev/null 2>&1; then
    LICHEN_VENV="$VENV" timeout 300 bash scripts/setup.sh ray,gpu > "$WORK/logs/setup.log" 2>&1 \
      || { echo "setup failed: see $WORK/logs/setup.log"; tail -5 "$WORK/logs/setup.log"; exit 1; }
  fi
  if ! "$PY" -c "import torch; assert torch.cuda.is_available()" >/dev/null 2>&1; then
    echo "gpu_check.sh: $VENV's torch sees no CUDA device ($("$PY" -c 'import torch; print(torch.__version__)'))." \
         "Run it on a GPU machine, or --dry-run." >&2
    exit 1
  fi
  "$PY" -c "import torch_memory_saver" >/dev/null 2>&1 \
    || timeout 180 "$PY" -m pip install -q 'torch-memory-saver>=0.0.10' >> "$WORK/logs/setup.log" 2>&1 \
    || echo "torch_memory_saver did not install (logs/setup.log): the memory_saver row will fail saying so"
  row setup "ok ($("$PY" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))'))" \
    $((SECONDS - t0)) -
fi

# --- inputs: a tiny llama (head_dim 64: SGLang's attention kernels take that size) and a prompt file -------------
MODEL="$WORK/model"
DATA="$WORK/train.jsonl"
if "$PY" -c "import lichen" >/dev/null 2>&1; then
  [ -f "$MODEL/config.json" ] || "$LICHEN" make-tiny-model "$MODEL" --arch llama --hidden-size 256 --num-layers 2 \
    --num-heads 4 --intermediate-size 512 --seed 0 > "$WORK/logs/model.log" 2>&1
  "$PY" - "$DATA" <<'PY'
import json, random, sys
rng = random.Random(0)
with open(sys.argv[1], "w") as f:
    for _ in range(64):
        a, b = rng.randrange(100), rng.randrange(100)
        f.write(json.dumps({"prompt": f"{a}+{b}=", "label": str(a + b)}) + "\n")
PY
fi

# Flags every run shares: 3 steps of 4 prompts x 4 samples, 8 new tokens.
COMMON=(--hf-checkpoint "$MODEL" --prompt-data "$DATA" --rm-type leading_number --device cuda --bf16
        --num-rollout 3 --rollout-batch-size 4 --n-samples-per-prompt 4 --rollout-max-response-len 8
        --micro-batch-size 16 --lr 1e-4 --no-progress)
RAY_ONE=(--runtime ray --actor-num-nodes 1 --actor-num-gpus-per-node 1 --rollout-num-gpus 1)

run_check train_cuda_bf16 90 "$LICHEN" train "${COMMON[@]}" --output-dir "$WORK/out/train_cuda_bf16"

run_check memory_saver 150 "$LICHEN" train "${COMMON[@]}" "${RAY_ONE[@]}" --colocate \
  --update-weight-transport disk --update-weight-disk-dir "$WORK/weights/memory_saver" \
  --output-dir "$WORK/out/memory_saver"

run_check tensor_ipc 120 "$LICHEN" train "${COMMON[@]}" --colocate --rollout-num-engines 1 \
  --update-weight-transport tensor --output-dir "$WORK/out/tensor_ipc"

GPUS=0
[ "$DRY" = 0 ] && GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$DRY" = 1 ] || [ "$GPUS" -ge 2 ]; then
  run_check nccl_sync 150 "$LICHEN" train "${COMMON[@]}" "${RAY_ONE[@]}" --update-weight-transport nccl \
    --output-dir "$WORK/out/nccl_sync"
else
  row nccl_sync "skipped: $GPUS GPU(s); NCCL between a trainer rank and an engine needs 2 (one group refuses two ranks on one device)" 0 -
fi

# SGLang pins its own torch: it gets a venv of its own, with lichen installed into it (the engine is started with
# lichen's Python, as sys.executable). A failed or over-long install skips the row with the reason.
SG_INSTALL=(bash -c "python3 -m venv '$SGV' && '$SGV/bin/python' -m pip install -q sglang && '$SGV/bin/python' -m pip install -q -e ." )
SG_RUN=("$SGV/bin/lichen" train "${COMMON[@]}" --rollout-engine-backend sglang --rollout-num-engines 1
        --sglang-mem-fraction-static 0.3 --update-weight-transport disk
        --update-weight-disk-dir "$WORK/weights/sglang_engine" --output-dir "$WORK/out/sglang_engine")
if [ "$DRY" = 1 ]; then
  run_check sglang_install 240 "${SG_INSTALL[@]}"
  run_check sglang_engine 150 "${SG_RUN[@]}"
elif [ -x "$SGV/bin/lichen" ] && "$SGV/bin/python" -c "import sglang" >/dev/null 2>&1 \
    || run_check sglang_install 240 "${SG_INSTALL[@]}"; then
  run_check sglang_engine 150 "${SG_RUN[@]}"
else
  row sglang_engine "skipped: sglang did not install (logs/sglang_install.log)" 0 -
fi

run_check packed_attention 90 "$LICHEN" bench packed --device cuda --dtype bfloat16 --repeats 3 --threads 1

# --- the table ---------------------------------------------------------------------------------------------------
echo
printf '| %-16s | %-60s | %7s | %-18s |\n' check result seconds "peak device memory"
printf '|%s|%s|%s|%s|\n' "------------------" "--------------------------------------------------------------" \
  "---------" "--------------------"
FAILED=0
for r in "${ROWS[@]}"; do
  IFS='|' read -r c res s p <<< "$r"
  printf '| %-16s | %-60s | %7s | %-18s |\n' "$c" "$res" "$s" "$p"
  [[ "$res" == FAIL* ]] && FAILED=1
done
if [ "$DRY" = 0 ]; then
  # Per-phase peaks the runs logged (memory/<phase>_cuda_max_allocated_gb; on Ray per rank and engine).
  for name in train_cuda_bf16 memory_saver tensor_ipc nccl_sync sglang_engine; do
    f="$WORK/out/$name/metrics.jsonl"
    [ -f "$f" ] || continue
    "$PY" - "$name" "$f" <<'PY'
import json, sys
peaks: dict[str, float] = {}
for line in open(sys.argv[2]):
    for k, v in json.loads(line).items():
        if k.startswith("memory/") and ("cuda_max_allocated" in k or "peak_rss" in k) and isinstance(v, (int, float)):
            peaks[k] = max(peaks.get(k, 0.0), float(v))
print(f"{sys.argv[1]}: " + (", ".join(f"{k[7:]}={v:.3f}" for k, v in sorted(peaks.items())) or "no memory metrics"))
PY
  done
  [ -f "$WORK/logs/packed_attention.log" ] && grep -E "^(per segment / dense|max \|)" "$WORK/logs/packed_attention.log" \
    | sed 's/^/packed_attention: /'
  echo "total $((SECONDS - START)) s; logs in $WORK/logs"
fi
exit "$FAILED"
