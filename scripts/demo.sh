#!/usr/bin/env bash
# The main job from a fresh clone: set up .venv, build the tiny models, train the tiny policy with
# PPO, then show base vs trained side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PPO="$(dirname "$PY")/ppo"

"$PY" scripts/make_tiny_models.py --out models/tiny
"$PPO" train recipes/tiny_sentiment.yaml --overwrite "$@"
"$PPO" compare base aligned --prompts recipes/prompts/reviews_eval.txt --run runs/tiny-sentiment
