#!/usr/bin/env bash
# Runs the test suite (creating .venv first if needed). Extra arguments go to pytest,
# e.g. scripts/test.sh -m "not slow" for the fast unit tests only.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PY" -m pytest "$@"
