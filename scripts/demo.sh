#!/usr/bin/env bash
# The main job from a fresh clone: set up .venv, build the tiny models, train the tiny policy with
# PPO, then show base vs trained side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PPO="$(dirname "$PY")/ppo"

# The tiny models are built once per version of their builder, in the cache the test suite uses too
# (tests/fixtures/model_cache.py), and models/tiny points there.
built="$("$PY" -m tests.fixtures.model_cache)"
[ -f "$built/policy/config.json" ] || "$PY" scripts/make_tiny_models.py --out "$built" --no-tools
mkdir -p models
[ -L models/tiny ] || rm -rf models/tiny
ln -sfn "../$built" models/tiny
"$PPO" train recipes/tiny_sentiment.yaml --overwrite "$@"
"$PPO" compare base aligned --prompts recipes/prompts/reviews_eval.txt --run runs/tiny-sentiment
