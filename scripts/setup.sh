#!/usr/bin/env bash
# Creates .venv and installs lichen into it. On a machine without an NVIDIA GPU the CPU build of torch is
# installed first (a plain `pip install torch` would pull a multi-GB CUDA build). GPU users keep their torch.
# Usage: scripts/setup.sh [extra,extra...]   e.g. scripts/setup.sh test
#
# Versions: every package except torch is installed within constraints/tested.txt, the set the suite last passed
# with (written by scripts/freeze_constraints.sh, changed only on purpose), so an install never depends on what a
# registry published that morning. LICHEN_LATEST=1 ignores that file and upgrades to the newest versions
# pyproject.toml allows (`make test-latest`). LICHEN_VENV names the environment (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
EXTRAS="${1:-}"
VENV="${LICHEN_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
PIN=(-c constraints/tested.txt)
if [ "${LICHEN_LATEST:-0}" = 1 ]; then
  PIN=(--upgrade --upgrade-strategy eager)
fi
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    "$VPY" -m pip install -q "torch>=2.5"
  else
    # CPU-only machine: the CPU wheel (a local file where one lies in pip's find-links, else PyTorch's CPU index).
    "$VPY" -m pip install -q "torch==2.13.0" 2>/dev/null \
      || "$VPY" -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi
# torch stays the build installed above (CPU here, the user's CUDA build on GPUs): an upgrade or a pin elsewhere
# must never swap it for another build.
TORCH_PIN="$VENV/torch-pin.txt"
"$VPY" -c "import torch; print('torch==' + torch.__version__)" > "$TORCH_PIN"
PIN+=(-c "$TORCH_PIN")
TARGET="."
[ -n "$EXTRAS" ] && TARGET=".[$EXTRAS]"
if ! "$VPY" -m pip install -q "${PIN[@]}" -e "$TARGET"; then
  [ "${LICHEN_LATEST:-0}" = 1 ] && exit 1
  # e.g. a Python version the tested set has no wheels for: say so, then take the newest allowed versions
  echo "setup: the tested versions (constraints/tested.txt) do not install here; installing the newest versions" \
       "pyproject.toml allows instead (what \`make test-latest\` tests)" >&2
  "$VPY" -m pip install -q -c "$TORCH_PIN" -e "$TARGET"
fi
# what is installed changed: the mark of a passing suite (make test-latest, scripts/freeze_constraints.sh) is stale
rm -f "$VENV/.suite-green"
# The test extra also wants a browser for the report page test (tests/test_report.py): Debian's chromium, where
# this runs as root with apt-get. Never fatal: without it that one test skips and says why.
if [[ ",$EXTRAS," == *",test,"* ]] && [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] \
    && command -v apt-get >/dev/null 2>&1; then
  echo "installing chromium (Debian package) for the report page test ..."
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
    >/dev/null 2>&1 || echo "could not install chromium: tests/test_report.py's browser test will skip"
fi
"$VPY" -c "import torch, lichen; print(f'lichen ready: torch {torch.__version__}, cuda={torch.cuda.is_available()}')"
