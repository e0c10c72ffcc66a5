import pytest
import torch

from ppo_cli.algo.advantages import shape_rewards
from ppo_cli.algo.masking import masked_whiten
from ppo_cli.algo.reinforce import (
    discounted_returns,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
)

TOL = dict(rtol=1e-6, atol=1e-6)


def reinforce_pp(scores, kl, kl_coef, mask, gamma=1.0):
    """REINFORCE++ from the scores: the shaped rewards, then ``reinforce_plus_plus_advantages``."""
    rewards, _ = shape_rewards(scores, kl, kl_coef, mask)
    return reinforce_plus_plus_advantages(rewards, mask, gamma)


def reinforce_pp_baseline(scores, kl, kl_coef, mask, group_size, gamma=1.0):
    _, non_score_rewards = shape_rewards(scores, kl, kl_coef, mask)
    return reinforce_plus_plus_baseline_advantages(scores, non_score_rewards, mask, group_size, gamma)


# Row 0 is truncated (fills all T = 3 positions), row 1 stopped after 2 tokens.
SCORES = torch.tensor([1.0, -1.0], dtype=torch.float64)
KL = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]], dtype=torch.float64)
MASK = torch.tensor([[True, True, True], [True, True, False]])


def test_discounted_returns_match_hand_computed_case():
    rewards = torch.tensor([[-0.05, -0.1, 0.85], [-0.2, -1.25, 9.0]], dtype=torch.float64)
    # gamma 0.5, row 0: R2 = 0.85, R1 = -0.1 + 0.425 = 0.325, R0 = -0.05 + 0.1625 = 0.1125;
    # row 1 stops at t = 1 (the 9 on padding is ignored): R1 = -1.25, R0 = -0.2 - 0.625 = -0.825
    expected = torch.tensor([[0.1125, 0.325, 0.85], [-0.825, -1.25, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(discounted_returns(rewards, MASK, gamma=0.5), expected, **TOL)


def test_reinforce_plus_plus_matches_hand_computed_case():
    advantages, returns = reinforce_pp(SCORES, KL, 0.5, MASK)
    # rewards: row 0 [-0.05, -0.1, -0.15 + 1]; row 1 [-0.2, -0.25 - 1]; gamma 1 sums them backwards
    torch.testing.assert_close(returns, torch.tensor([[0.7, 0.75, 0.85], [-1.45, -1.25, 0.0]], dtype=torch.float64), **TOL)
    # 5 real returns: mean -0.08, Bessel variance 5.408 / 4 = 1.352 -> (return - mean) / sqrt(1.352 + 1e-8)
    expected = torch.tensor([[0.6708203908, 0.7138216979, 0.7998243121], [-1.1782358146, -1.0062305862, 0.0]],
                            dtype=torch.float64)
    torch.testing.assert_close(advantages, expected, **TOL)


def test_reinforce_plus_plus_first_token_return_is_score_minus_total_kl_penalty():
    _, returns = reinforce_pp(SCORES, KL, 0.5, MASK)
    # row 0: 1 - 0.5 * 0.6; row 1: -1 - 0.5 * 0.9
    torch.testing.assert_close(returns[:, 0], torch.tensor([0.7, -1.45], dtype=torch.float64), **TOL)


def test_reinforce_plus_plus_baseline_matches_hand_computed_case():
    # two prompts, G = 2: scores [3, 1 | 2, 2] -> centred [1, -1 | 0, 0]; every token pays 0.5 * 0.2
    scores = torch.tensor([3.0, 1.0, 2.0, 2.0], dtype=torch.float64)
    kl = torch.full((4, 2), 0.2, dtype=torch.float64)
    mask = torch.tensor([[True, True], [True, False], [True, True], [True, True]])
    advantages, returns = reinforce_pp_baseline(scores, kl, 0.5, mask, group_size=2)
    # returns: [-0.1 + 0.9, 0.9], [-1.1], [-0.2, -0.1], [-0.2, -0.1]
    expected_returns = torch.tensor([[0.8, 0.9], [-1.1, 0.0], [-0.2, -0.1], [-0.2, -0.1]], dtype=torch.float64)
    torch.testing.assert_close(returns, expected_returns, **TOL)
    # 7 real returns sum to 0; Bessel variance 2.76 / 6 = 0.46
    expected = torch.tensor([[1.1795356364, 1.3269775910], [-1.6218615001, 0.0], [-0.2948839091, -0.1474419546],
                             [-0.2948839091, -0.1474419546]], dtype=torch.float64)
    torch.testing.assert_close(advantages, expected, **TOL)


def test_reinforce_plus_plus_baseline_without_kl_is_verls_whitened_centred_scores():
    # verl's compute_reinforce_plus_plus_baseline_outcome_advantage: (score - group mean) on every token, whitened
    generator = torch.Generator().manual_seed(3)
    scores = torch.randn(6, generator=generator, dtype=torch.float64)
    mask = torch.arange(5) < torch.tensor([5, 2, 4, 1, 5, 3]).unsqueeze(1)
    advantages, _ = reinforce_pp_baseline(scores, torch.zeros(6, 5, dtype=torch.float64), 0.0, mask, 3)
    centred = scores - scores.view(2, 3).mean(dim=1).repeat_interleave(3)
    torch.testing.assert_close(advantages, masked_whiten(centred.unsqueeze(1).expand(6, 5), mask), **TOL)


def test_reinforce_plus_plus_advantages_have_zero_mean_and_unit_variance_over_real_tokens():
    generator = torch.Generator().manual_seed(4)
    scores = torch.randn(5, generator=generator, dtype=torch.float64)
    kl = torch.rand(5, 7, generator=generator, dtype=torch.float64)
    mask = torch.arange(7) < torch.tensor([7, 3, 0, 5, 7]).unsqueeze(1)
    advantages, _ = reinforce_pp(scores, kl, 0.1, mask, gamma=0.9)
    real = advantages[mask]
    assert real.mean().item() == pytest.approx(0.0, abs=1e-12)
    assert real.var().item() == pytest.approx(1.0, rel=1e-6)
    assert (advantages[~mask] == 0).all()


def test_reinforce_plus_plus_ignores_nan_kl_on_padding():
    kl = KL.clone()
    kl[1, 2] = float("nan")
    expected = reinforce_pp(SCORES, KL, 0.5, MASK)
    for got, want in zip(reinforce_pp(SCORES, kl, 0.5, MASK), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
