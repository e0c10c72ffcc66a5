#!/usr/bin/env bash
# Creates a venv (default .venv at the repository root; or the directory given as the first argument)
# if missing, and installs torch (the CPU build on a machine without CUDA, scripts/venv_lib.sh) and
# ppo_cli into it (idempotent). Sourced by scripts/demo.sh and scripts/test.sh; sets $PY to the venv's python.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/venv_lib.sh"
VENV="${1:-$ROOT/.venv}"

make_venv "$VENV"
install_torch
stamp="$VENV/.ppo_cli-installed"
if needs_install "$stamp"; then
  echo "setup: installing ppo_cli and its dependencies into $VENV"
  "$PY" -m pip install -q -e "$ROOT[dev,plot]"
  touch "$stamp"
fi
export PY
