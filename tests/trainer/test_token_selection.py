"""trainer.select_high_entropy_tokens: ppo.top_entropy_quantile's weights on the policy loss."""

from __future__ import annotations

import pytest
import torch

from ppo_cli.algo.losses import clipped_policy_loss
from ppo_cli.train_metrics import UpdateStats
from ppo_cli.trainer import select_high_entropy_tokens

ENTROPY = torch.tensor([[0.1, 0.5, 0.9, 9.0], [0.3, 0.7, 0.2, 0.0]])
MASK = torch.tensor([[True, True, True, False], [True, True, False, False]])


def test_low_entropy_tokens_leave_the_loss_and_the_normaliser_stays():
    stats = UpdateStats()
    weights = select_high_entropy_tokens(ENTROPY, MASK, 0.4, None, stats)  # keeps 0.9 and 0.7 (threshold 0.58)
    assert weights.tolist() == [[0.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]]
    assert stats.values["entropy_threshold"] == [pytest.approx(0.58)]
    # ratio 1 (new = old log-probs): per-token loss -A; kept tokens' advantages 2 and -1 over 5 masked tokens
    advantages = torch.tensor([[1.0, 1.0, 2.0, 5.0], [3.0, -1.0, 4.0, 4.0]])
    logprobs = torch.zeros(2, 4)
    loss = clipped_policy_loss(logprobs, logprobs, advantages, MASK, 0.2, token_weights=weights).loss
    assert loss.item() == pytest.approx(-(2.0 - 1.0) / 5)  # TRL: per_token_loss * entropy_mask, / mask.sum()


def test_importance_weights_multiply_in():
    is_weights = torch.full((2, 4), 0.5)
    weights = select_high_entropy_tokens(ENTROPY, MASK, 0.4, is_weights, UpdateStats())
    assert weights.tolist() == [[0.0, 0.0, 0.5, 0.0], [0.0, 0.5, 0.0, 0.0]]


def test_with_several_processes_the_threshold_is_over_the_gathered_tokens():
    other = torch.tensor([[2.0, 3.0, 9.0, 9.0], [0.0, 0.0, 0.0, 0.0]])
    other_mask = torch.tensor([[True, True, False, False], [False, False, False, False]])
    stats = UpdateStats()
    weights = select_high_entropy_tokens(ENTROPY, MASK, 0.5, None, stats,
                                         gather=lambda t: torch.cat([t, other_mask if t.dtype == torch.bool else other]))
    assert stats.values["entropy_threshold"] == [pytest.approx(0.7)]  # 0.1 0.3 0.5 [0.7] 0.9 2 3
    assert weights.tolist() == [[0.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]]
