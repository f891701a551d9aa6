#!/usr/bin/env bash
# Creates .venv and installs lichen into it. On a machine without an NVIDIA GPU the CPU build of torch is
# installed first (a plain `pip install torch` would pull a multi-GB CUDA build). GPU users keep their torch.
# Usage: scripts/setup.sh [extra,extra...]   e.g. scripts/setup.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
EXTRAS="${1:-}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    "$VPY" -m pip install -q "torch>=2.5"
  else
    # CPU-only machine: the CPU wheel (a local file where one lies in pip's find-links, else PyTorch's CPU index).
    "$VPY" -m pip install -q "torch==2.13.0" 2>/dev/null \
      || "$VPY" -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi
if [ -n "$EXTRAS" ]; then
  "$VPY" -m pip install -q -e ".[$EXTRAS]"
else
  "$VPY" -m pip install -q -e .
fi
# The test extra also wants a browser for the report page test (tests/test_report.py): Debian's chromium, where
# this runs as root with apt-get. Never fatal: without it that one test skips and says why.
if [[ ",$EXTRAS," == *",test,"* ]] && [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] \
    && command -v apt-get >/dev/null 2>&1; then
  echo "installing chromium (Debian package) for the report page test ..."
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
    >/dev/null 2>&1 || echo "could not install chromium: tests/test_report.py's browser test will skip"
fi
"$VPY" -c "import torch, lichen; print(f'lichen ready: torch {torch.__version__}, cuda={torch.cuda.is_available()}')"
