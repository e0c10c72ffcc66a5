"""A frozen reward model computes under the run's autocast (engine/rewards/model.py ModelScorer): how far
its scores move from float32 under bf16, on the tiny classifier and 128 review texts."""

from __future__ import annotations

import pytest
import torch

from ppo_cli.engine.rewards.model import ModelScorer
from ppo_cli.recipe import ClassifierReward
from tests.conftest import ROOT

pytestmark = pytest.mark.slow

# 64 prompts from the shipped review recipes, each with two endings the classifier reads differently
TEXTS = [line + ending for line in (ROOT / "recipes/prompts/reviews.txt").read_text().splitlines()
         + (ROOT / "recipes/prompts/reviews_eval.txt").read_text().splitlines()
         for ending in (" great, I loved every minute.", " dull and far too long.")]
# Measured on an AMD EPYC (avx2, no avx512_bf16), torch 2.13: rewards (range -0.83..9.97) moved at most
# 0.0037, logits (range -2.32..4.40) at most 0.0173. The bounds leave room for another CPU's bf16 kernels.
MAX_REWARD_MOVE = 0.02  # rewards -1 / 0.1 / 10 x the label's probability
MAX_LOGIT_MOVE = 0.05  # a scalar reward model's score is its logit (type: model reads logits[:, 0])


def test_reward_model_scores_under_bf16_stay_within_a_bound_of_float32(tiny_models):
    component = ClassifierReward(type="classifier", path=str(tiny_models / "reward"), text="response",
                                 labels={"negative": -1.0, "neutral": 0.1, "positive": 10.0}, scale_by_confidence=True)
    scorer = ModelScorer(component, torch.device("cpu"))
    logits, rewards = {}, {}
    for precision in ("no", "bf16"):
        scorer.mixed_precision = precision
        rewards[precision] = torch.tensor(scorer([""] * len(TEXTS), TEXTS))
        enc = scorer.tokenizer(TEXTS, return_tensors="pt", padding=True)
        with torch.no_grad(), scorer.autocast():
            logits[precision] = scorer.model(**enc).logits.float()
    reward_move = (rewards["bf16"] - rewards["no"]).abs().max().item()
    logit_move = (logits["bf16"] - logits["no"]).abs().max().item()
    print(f"bf16 vs float32 over {len(TEXTS)} texts: rewards move at most {reward_move:.4f} "
          f"(range {rewards['no'].min():.2f}..{rewards['no'].max():.2f}), logits at most {logit_move:.4f} "
          f"(range {logits['no'].min():.2f}..{logits['no'].max():.2f})")
    assert 0 < reward_move < MAX_REWARD_MOVE  # > 0: the forward did run under autocast
    assert 0 < logit_move < MAX_LOGIT_MOVE
