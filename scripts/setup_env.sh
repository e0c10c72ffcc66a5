#!/usr/bin/env bash
# Creates a venv (default .venv at the repository root; PPO_VENV=DIR for another) if missing, and
# installs torch (the CPU build on a machine without CUDA, scripts/venv_lib.sh) and ppo_cli into it
# (idempotent). Sourced by scripts/demo.sh and scripts/test.sh; sets $PY to the venv's python.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/venv_lib.sh"
# Not "$1": a sourced script sees its caller's arguments (scripts/test.sh -q would name a venv "-q").
VENV="${PPO_VENV:-$ROOT/.venv}"

make_venv "$VENV"
install_torch
stamp="$VENV/.ppo_cli-installed"
if needs_install "$stamp"; then
  echo "setup: installing ppo_cli and its dependencies into $VENV"
  "$PY" -m pip install -q -e "$ROOT[dev,plot,tensorboard]"
  touch "$stamp"
fi
export PY
