#!/usr/bin/env bash
# Creates .venv at the repository root if missing and installs ppo_cli into it (idempotent).
# Sourced by scripts/demo.sh and scripts/test.sh; sets $PY to the venv's python.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"

if [ ! -x "$PY" ]; then
  echo "setup: creating $VENV"
  python3 -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
fi

# torch first: on a machine without CUDA, take the CPU build (torch==2.13.0 resolves to a local CPU
# wheel on our machines); an unpinned torch would pull gigabytes of CUDA packages.
# Override with PPO_TORCH_SPEC (e.g. "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu").
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    spec="${PPO_TORCH_SPEC:-torch}"
  else
    spec="${PPO_TORCH_SPEC:-torch==2.13.0}"
  fi
  echo "setup: installing $spec"
  # shellcheck disable=SC2086
  "$PY" -m pip install -q $spec
fi

stamp="$VENV/.ppo_cli-installed"
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ]; then
  echo "setup: installing ppo_cli and its dependencies into .venv"
  "$PY" -m pip install -q -e "$ROOT[dev,plot]"
  touch "$stamp"
fi
export PY
