import pytest
import torch

from ppo_cli.algo.advantages import compute_gae, last_token_index, shape_rewards

TOL = dict(rtol=1e-6, atol=1e-6)


def random_episode(seed, batch=6, length=9):
    """Random rewards/values with right-padded masks; row lengths include 0 and full."""
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=generator, dtype=torch.float64)
    values = torch.randn(batch, length, generator=generator, dtype=torch.float64)
    lengths = torch.randint(0, length + 1, (batch,), generator=generator)
    lengths[0], lengths[1] = length, 0
    response_mask = torch.arange(length) < lengths.unsqueeze(1)
    return rewards, values, response_mask


def plain_loop_gae(rewards, values, response_mask, gamma, lam):
    """One row at a time, one token at a time, stopping at each row's own last real token."""
    advantages = torch.zeros_like(rewards)
    returns = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        length = int(response_mask[b].sum())
        advantage = 0.0
        for t in reversed(range(length)):
            next_value = values[b, t + 1].item() if t + 1 < length else 0.0
            delta = rewards[b, t].item() + gamma * next_value - values[b, t].item()
            advantage = delta + gamma * lam * advantage
            advantages[b, t] = advantage
            returns[b, t] = advantage + values[b, t].item()
    return advantages, returns


def test_last_token_index_matches_hand_computed_case():
    response_mask = torch.tensor(
        [
            [True, True, False, False],
            [True, True, True, True],
            [False, False, False, False],
            [True, False, True, False],
        ]
    )
    # last True at 1; at 3 (full row); none -> 0; at 2 (a hole before it does not matter)
    assert last_token_index(response_mask).tolist() == [1, 3, 0, 2]
    assert last_token_index(response_mask).dtype == torch.long


def test_shape_rewards_matches_hand_computed_case():
    scores = torch.tensor([2.0, -1.0, 3.0])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9]])
    response_mask = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])
    rewards, non_score_rewards = shape_rewards(scores, kl, 0.5, response_mask)
    # -0.5 * kl on real tokens, 0 on padding; the empty third row gets nothing
    expected_non_score = torch.tensor([[-0.05, -0.1, -0.15], [-0.2, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # score added on the last real token: -0.15 + 2 = 1.85; -0.2 + (-1) = -1.2; empty row drops its score 3
    expected_rewards = torch.tensor([[-0.05, -0.1, 1.85], [-1.2, 0.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(non_score_rewards, expected_non_score, **TOL)
    torch.testing.assert_close(rewards, expected_rewards, **TOL)


@pytest.mark.parametrize("seed", range(5))
def test_shape_rewards_matches_plain_loop_on_random_inputs(seed):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(6, generator=generator, dtype=torch.float64)
    kl = torch.randn(6, 8, generator=generator, dtype=torch.float64)
    _, _, response_mask = random_episode(seed, batch=6, length=8)
    rewards, non_score_rewards = shape_rewards(scores, kl, 0.1, response_mask)
    for b in range(6):
        length = int(response_mask[b].sum())
        for t in range(8):
            penalty = -0.1 * kl[b, t].item() if t < length else 0.0
            bonus = scores[b].item() if t == length - 1 else 0.0
            assert non_score_rewards[b, t].item() == pytest.approx(penalty, abs=1e-12)
            assert rewards[b, t].item() == pytest.approx(penalty + bonus, abs=1e-12)


def test_shape_rewards_ignores_nan_kl_on_padding():
    kl = torch.tensor([[0.2, float("nan")]])
    rewards, _ = shape_rewards(torch.tensor([1.0]), kl, 1.0, torch.tensor([[True, False]]))
    # -1 * 0.2 + 1 on the only real token; padding stays 0 despite the NaN
    torch.testing.assert_close(rewards, torch.tensor([[0.8, 0.0]]), **TOL)


def test_shape_rewards_sums_to_score_minus_kl_coef_times_total_kl():
    _, _, response_mask = random_episode(7)
    generator = torch.Generator().manual_seed(7)
    scores = torch.randn(6, generator=generator, dtype=torch.float64)
    kl = torch.rand(6, 9, generator=generator, dtype=torch.float64)
    rewards, _ = shape_rewards(scores, kl, 0.05, response_mask)
    has_tokens = response_mask.any(dim=1)
    expected = torch.where(has_tokens, scores, 0) - 0.05 * (kl * response_mask).sum(dim=1)
    torch.testing.assert_close(rewards.sum(dim=1), expected, **TOL)


def test_compute_gae_matches_hand_computed_3_token_case():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    response_mask = torch.ones(1, 3, dtype=torch.bool)
    advantages, returns = compute_gae(rewards, values, response_mask, gamma=0.9, lam=0.8)
    # gamma*lam = 0.72; A2 = 1 - 0.7 = 0.3; A1 = (0.9*0.7 - 0.6) + 0.72*0.3 = 0.246; A0 = (0.9*0.6 - 0.5) + 0.72*0.246
    torch.testing.assert_close(advantages, torch.tensor([[0.21712, 0.246, 0.3]]), **TOL)
    # returns = A + V = [0.21712 + 0.5, 0.246 + 0.6, 0.3 + 0.7]
    torch.testing.assert_close(returns, torch.tensor([[0.71712, 0.846, 1.0]]), **TOL)


def test_compute_gae_stops_at_last_real_token_of_each_row():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0], [0.0, 2.0, 7.0, 7.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0], [1.0, 0.5, 3.0, 3.0]])
    response_mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    advantages, returns = compute_gae(rewards, values, response_mask, gamma=0.9, lam=0.8)
    # row 0 is the 3-token case (padding reward 5 and value 9 ignored);
    # row 1: A1 = 2 - 0.5 = 1.5; A0 = (0.9*0.5 - 1) + 0.72*1.5 = 0.53; returns [1.53, 2.0]
    torch.testing.assert_close(
        advantages, torch.tensor([[0.21712, 0.246, 0.3, 0.0], [0.53, 1.5, 0.0, 0.0]]), **TOL
    )
    torch.testing.assert_close(returns, torch.tensor([[0.71712, 0.846, 1.0, 0.0], [1.53, 2.0, 0.0, 0.0]]), **TOL)


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.99, 0.95), (0.9, 0.0), (1.0, 1.0)])
def test_compute_gae_matches_plain_loop_on_random_inputs(seed, gamma, lam):
    rewards, values, response_mask = random_episode(seed)
    advantages, returns = compute_gae(rewards, values, response_mask, gamma, lam)
    expected_advantages, expected_returns = plain_loop_gae(rewards, values, response_mask, gamma, lam)
    torch.testing.assert_close(advantages, expected_advantages, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(returns, expected_returns, rtol=1e-9, atol=1e-9)


def test_compute_gae_with_lambda_zero_is_one_step_td():
    rewards, values, response_mask = random_episode(11)
    advantages, _ = compute_gae(rewards, values, response_mask, gamma=0.9, lam=0.0)
    values = values * response_mask
    next_values = torch.cat([values[:, 1:], torch.zeros(values.shape[0], 1, dtype=values.dtype)], dim=1)
    td = (rewards + 0.9 * next_values - values) * response_mask
    torch.testing.assert_close(advantages, td, **TOL)


def test_compute_gae_with_gamma_and_lambda_one_is_reward_to_go_minus_value():
    rewards, values, response_mask = random_episode(12)
    advantages, returns = compute_gae(rewards, values, response_mask, gamma=1.0, lam=1.0)
    masked_rewards = rewards * response_mask
    reward_to_go = masked_rewards.flip(1).cumsum(1).flip(1) * response_mask
    torch.testing.assert_close(returns, reward_to_go, **TOL)
    torch.testing.assert_close(advantages, reward_to_go - values * response_mask, **TOL)


def test_compute_gae_ignores_nan_outside_mask():
    rewards, values, response_mask = random_episode(13)
    expected = compute_gae(rewards, values, response_mask, 1.0, 0.95)
    poisoned_rewards, poisoned_values = rewards.clone(), values.clone()
    poisoned_rewards[~response_mask] = float("nan")
    poisoned_values[~response_mask] = float("inf")
    advantages, returns = compute_gae(poisoned_rewards, poisoned_values, response_mask, 1.0, 0.95)
    torch.testing.assert_close(advantages, expected[0], rtol=0, atol=0)
    torch.testing.assert_close(returns, expected[1], rtol=0, atol=0)


def test_advantage_functions_do_not_mutate_inputs():
    rewards, values, response_mask = random_episode(14)
    scores, kl = rewards[:, 0].clone(), values.clone()
    snapshot = [x.clone() for x in (rewards, values, response_mask, scores, kl)]
    last_token_index(response_mask)
    shape_rewards(scores, kl, 0.1, response_mask)
    compute_gae(rewards, values, response_mask, 1.0, 0.95)
    for before, after in zip(snapshot, (rewards, values, response_mask, scores, kl)):
        assert torch.equal(before, after)
