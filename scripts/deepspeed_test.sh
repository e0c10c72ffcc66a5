#!/usr/bin/env bash
# Runs the DeepSpeed tests (ZeRO-2 and ZeRO-3, two CPU processes over gloo) in a venv of their own,
# .venv-deepspeed/, made if missing, so that the main .venv and its fast suite never need deepspeed.
#
# torch 2.13.0 first (without CUDA the CPU build, scripts/venv_lib.sh), then ppo_cli with its 'deepspeed' extra.
# Without CUDA DeepSpeed picks its CPU accelerator (DS_ACCELERATOR=cpu says so explicitly), which talks
# over gloo, and builds a small shared-memory op with the system C++ compiler and ninja on first use
# (cached under ~/.cache/torch_extensions). On 2 shared cores: about 2 minutes to create the venv, then
# about 1.5 minutes for the tests. Extra arguments go to pytest; --setup-only makes the venv and stops.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
VENV="${PPO_VENV:-$ROOT/.venv-deepspeed}"
source scripts/venv_lib.sh

make_venv "$VENV"
stamp="$VENV/.ppo_cli-deepspeed-installed"
if needs_install "$stamp"; then
  install_torch
  "$PY" -m pip install -q -e "$ROOT[deepspeed]" pytest
  DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}" "$PY" -c "import deepspeed; from deepspeed.accelerator import get_accelerator as a; print('deepspeed_test: deepspeed', deepspeed.__version__, 'accelerator', a()._name, 'backend', a().communication_backend_name())"
  touch "$stamp"
fi

[ "${1:-}" = "--setup-only" ] && exit 0

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
command -v nvidia-smi >/dev/null 2>&1 || export DS_ACCELERATOR=cpu
# The unit tests of the settings too: against the installed deepspeed and accelerate.
# And docs/distributed.md's ZeRO-3 command on the shipped tiny recipe, end to end.
exec "$PY" -m pytest tests/integration/test_deepspeed.py tests/distributed/test_deepspeed_config.py \
  tests/integration/test_readme_multiprocess.py::test_the_readme_zero3_command_trains_and_evaluates "$@"
