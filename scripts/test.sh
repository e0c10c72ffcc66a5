#!/usr/bin/env bash
# Runs the test suite (creating .venv first if needed). Extra arguments go to pytest,
# e.g. scripts/test.sh -m "not slow" for the fast unit tests only.
# The tests run in PPO_TEST_WORKERS processes (pytest-xdist; default: the CPU count, at most 4; each
# test file goes whole to the next idle worker, longest files first (tests/conftest.py: run_order), so
# no module-scoped run is repeated on two workers and the short files fill the tail), each
# with its share of the cores for torch (tests/conftest.py); PPO_TEST_WORKERS=1 runs them in this process.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
workers="${PPO_TEST_WORKERS:-$(nproc 2>/dev/null || echo 1)}"
[ "$workers" -gt 4 ] && [ -z "${PPO_TEST_WORKERS:-}" ] && workers=4
case " $* " in *" -n "*|*" --numprocesses"*|*" -n="*) workers=1 ;; esac  # the caller chose
if [ "$workers" -gt 1 ]; then
  exec "$PY" -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
fi
exec "$PY" -m pytest "$@"
