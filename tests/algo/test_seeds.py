"""The seed documents' self-checking examples, ported to our functions.

- 001 (textbook chapter, "PPO clipped surrogate objective — pure NumPy"): the 4-step worked
  example, with every intermediate number derived by hand below.
- 004 (reference page, "The clipped surrogate and KL" / "The value model and GAE"): its 9 asserts
  on the clipped surrogate and its 5 asserts on GAE, one test each.
"""


import torch

from ppo_cli.algo.advantages import compute_gae, shape_rewards
from ppo_cli.algo.losses import clipped_policy_loss
from ppo_cli.algo.masking import masked_mean, masked_var

TOL = dict(rtol=1e-6, atol=1e-6)


def f64(x):
    return torch.tensor(x, dtype=torch.float64)

# ---------------------------------------------------------------------------------------------
# 001: worked example of the clipped surrogate
# ---------------------------------------------------------------------------------------------

ACTIONS = torch.tensor([[0, 2, 1, 0]])
OLD_LOGPROBS = torch.tensor([[-1.20, -0.51, -1.61, -0.92]], dtype=torch.float64)
RAW_ADVANTAGES = torch.tensor([[0.80, 1.50, -0.40, -1.20]], dtype=torch.float64)
NEW_LOGITS = torch.tensor(
    [[[1.10, -0.20, 0.30], [-0.40, 0.80, 1.60], [0.10, 1.40, 0.20], [1.30, -0.50, 0.10]]],
    dtype=torch.float64,
)
ALL_STEPS = torch.ones(1, 4, dtype=torch.bool)


def seed_001_normalised_advantages():
    # The seed divides by numpy's std(), the population (biased) one, plus 1e-8.
    mean = masked_mean(RAW_ADVANTAGES, ALL_STEPS)
    std = masked_var(RAW_ADVANTAGES, ALL_STEPS, unbiased=False).sqrt()
    return (RAW_ADVANTAGES - mean) / (std + 1e-8)


def seed_001_new_logprobs():
    return torch.log_softmax(NEW_LOGITS, dim=-1).gather(-1, ACTIONS.unsqueeze(-1)).squeeze(-1)


def test_seed_001_new_logprobs_match_hand_computed_log_softmax():
    # logit[a] - log(sum e^logits): 1.10 - 1.643405542; 1.60 - 2.060372554; 1.40 - 1.853446059; 1.30 - 1.682873904
    expected = torch.tensor([[-0.543405542, -0.460372554, -0.453446059, -0.382873904]], dtype=torch.float64)
    torch.testing.assert_close(seed_001_new_logprobs(), expected, **TOL)


def test_seed_001_normalised_advantages_match_hand_computed_values():
    # mean 0.7 / 4 = 0.175; deviations [0.625, 1.325, -0.575, -1.375]; population var 4.3675 / 4 = 1.091875
    # std sqrt(1.091875) = 1.044928227 -> deviations / std
    expected = torch.tensor([[0.598127199, 1.268029663, -0.550277023, -1.315879838]], dtype=torch.float64)
    torch.testing.assert_close(seed_001_normalised_advantages(), expected, **TOL)


def test_seed_001_ratios_match_hand_computed_values():
    ratio = (seed_001_new_logprobs() - OLD_LOGPROBS).exp()
    # exp(new - old): exp(0.656594458), exp(0.049627446), exp(1.156553941), exp(0.537126096)
    expected = torch.tensor([[1.928214525, 1.050879515, 3.178959496, 1.711082302]], dtype=torch.float64)
    torch.testing.assert_close(ratio, expected, **TOL)


def test_seed_001_policy_loss_matches_hand_computed_value():
    out = clipped_policy_loss(
        seed_001_new_logprobs(), OLD_LOGPROBS, seed_001_normalised_advantages(), ALL_STEPS, cliprange=0.2
    )
    # step 0: A > 0, r 1.93 clips to 1.2 -> -1.2 * 0.598127199 = -0.717752639; the rest are unclipped
    # -A*r: -1.268029663 * 1.050879515 = -1.332546396; 0.550277023 * 3.178959496 = 1.749308369;
    # 1.315879838 * 1.711082302 = 2.251578703; mean of the four = 1.950588037 / 4 = 0.487647009
    torch.testing.assert_close(out.loss, f64(0.487647009), **TOL)
    # only step 0 takes the clipped branch: 1 of 4
    torch.testing.assert_close(out.clipfrac, f64(0.25), **TOL)
    # (1.928214525 + 1.050879515 + 3.178959496 + 1.711082302) / 4
    torch.testing.assert_close(out.ratio_mean, f64(1.967283960), **TOL)


# ---------------------------------------------------------------------------------------------
# 004: the 9 asserts on the clipped surrogate
# ---------------------------------------------------------------------------------------------

EPS = 0.2
#                        pos/above pos/below neg/below neg/above r==1(+) r==1(-)
SEED_ADVANTAGES = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
SEED_RATIOS = torch.tensor([1.5, 0.5, 0.5, 2.0, 1.0, 1.0], dtype=torch.float64)


def per_token_policy_loss(advantages, ratios, eps=EPS):
    """Each token's loss through our function: a one-hot mask makes the masked mean that token."""
    size = advantages.numel()
    losses = []
    for i in range(size):
        only_i = torch.arange(size) == i
        out = clipped_policy_loss(
            ratios.log().unsqueeze(0), torch.zeros(1, size, dtype=ratios.dtype),
            advantages.unsqueeze(0), only_i.unsqueeze(0), eps,
        )
        losses.append(out.loss)
    return torch.stack(losses)


def reference_policy_loss(advantages, ratios, eps=EPS):
    """The seed's slow per-element reference."""
    out = []
    for a, r in zip(advantages.tolist(), ratios.tolist()):
        r_clipped = min(max(r, 1.0 - eps), 1.0 + eps)
        out.append(max(-a * r, -a * r_clipped))
    return torch.tensor(out, dtype=torch.float64)


def test_seed_004_clipped_surrogate_matches_slow_reference():
    expected = reference_policy_loss(SEED_ADVANTAGES, SEED_RATIOS)
    torch.testing.assert_close(per_token_policy_loss(SEED_ADVANTAGES, SEED_RATIOS), expected, **TOL)
    # and the batched masked mean is the mean of the per-token references
    batched = clipped_policy_loss(
        SEED_RATIOS.log().unsqueeze(0), torch.zeros(1, 6, dtype=torch.float64),
        SEED_ADVANTAGES.unsqueeze(0), torch.ones(1, 6, dtype=torch.bool), EPS,
    )
    torch.testing.assert_close(batched.loss, expected.mean(), **TOL)


def test_seed_004_clipped_surrogate_at_ratio_one_is_plain_policy_gradient():
    loss = per_token_policy_loss(SEED_ADVANTAGES, SEED_RATIOS)
    # r == 1: loss = -A, so -1 for A = +1 and +1 for A = -1
    torch.testing.assert_close(loss[4:], torch.tensor([-1.0, 1.0], dtype=torch.float64), **TOL)


def test_seed_004_clipped_surrogate_clips_positive_advantage_above_one_plus_eps():
    # A = 1, r = 1.5 > 1.2: -(1 + 0.2) * 1
    torch.testing.assert_close(per_token_policy_loss(SEED_ADVANTAGES, SEED_RATIOS)[0], f64(-1.2), **TOL)


def test_seed_004_clipped_surrogate_leaves_positive_advantage_below_one_minus_eps_unclipped():
    # A = 1, r = 0.5 < 0.8: max(-0.5, -0.8) = -0.5, the clip bites one way only
    torch.testing.assert_close(per_token_policy_loss(SEED_ADVANTAGES, SEED_RATIOS)[1], f64(-0.5), **TOL)


def test_seed_004_clipped_surrogate_clips_negative_advantage_below_one_minus_eps():
    # A = -1, r = 0.5 < 0.8: -(1 - 0.2) * -1
    torch.testing.assert_close(per_token_policy_loss(SEED_ADVANTAGES, SEED_RATIOS)[2], f64(0.8), **TOL)


def test_seed_004_clipped_surrogate_leaves_negative_advantage_above_one_plus_eps_unclipped():
    # A = -1, r = 2.0 > 1.2: max(2.0, 1.2) = 2.0
    torch.testing.assert_close(per_token_policy_loss(SEED_ADVANTAGES, SEED_RATIOS)[3], f64(2.0), **TOL)


def test_seed_004_clipped_surrogate_is_never_below_unclipped_loss():
    loss = per_token_policy_loss(SEED_ADVANTAGES, SEED_RATIOS)
    assert torch.all(loss >= -SEED_ADVANTAGES * SEED_RATIOS - 1e-12)


def test_seed_004_clipped_surrogate_is_flat_past_the_clip():
    plateau = per_token_policy_loss(f64([1.0, 1.0]), f64([1.5, 1.9]))
    # both clip to -1.2 * 1
    torch.testing.assert_close(plateau[0], plateau[1], **TOL)
    torch.testing.assert_close(plateau[0], f64(-1.2), **TOL)


def test_seed_004_clipped_surrogate_differs_from_optimistic_min():
    clipped_ratios = SEED_RATIOS.clamp(1 - EPS, 1 + EPS)
    optimistic = torch.minimum(-SEED_ADVANTAGES * SEED_RATIOS, -SEED_ADVANTAGES * clipped_ratios)
    assert not torch.allclose(per_token_policy_loss(SEED_ADVANTAGES, SEED_RATIOS), optimistic)


# ---------------------------------------------------------------------------------------------
# 004: the 5 asserts on GAE
# ---------------------------------------------------------------------------------------------


def seed_episode():
    generator = torch.Generator().manual_seed(0)
    rewards = torch.randn(1, 8, generator=generator, dtype=torch.float64)
    values = torch.randn(1, 8, generator=generator, dtype=torch.float64)
    return rewards, values, torch.ones(1, 8, dtype=torch.bool)


def discounted_returns(rewards, gamma):
    """The seed's backward recursion R_t = r_t + gamma * R_{t+1}, for a (1, T) row."""
    out, running = [], 0.0
    for r in reversed(rewards[0].tolist()):
        running = r + gamma * running
        out.append(running)
    return torch.tensor([out[::-1]], dtype=torch.float64)


def double_sum_gae(rewards, values, gamma, lam):
    """The seed's slow reference: A_t = sum_{k >= t} (gamma * lam)^(k - t) * delta_k, V_T = 0."""
    r, v = rewards[0].tolist(), values[0].tolist() + [0.0]
    deltas = [r[t] + gamma * v[t + 1] - v[t] for t in range(len(r))]
    return torch.tensor(
        [[sum((gamma * lam) ** (k - t) * deltas[k] for k in range(t, len(r))) for t in range(len(r))]],
        dtype=torch.float64,
    )


def test_seed_004_gae_matches_slow_double_sum_reference():
    rewards, values, mask = seed_episode()
    advantages, _ = compute_gae(rewards, values, mask, gamma=0.99, lam=0.95)
    torch.testing.assert_close(advantages, double_sum_gae(rewards, values, 0.99, 0.95), rtol=1e-9, atol=1e-9)


def test_seed_004_gae_with_lambda_zero_is_one_step_td():
    rewards, values, mask = seed_episode()
    advantages, _ = compute_gae(rewards, values, mask, gamma=0.99, lam=0.0)
    next_values = torch.cat([values[:, 1:], torch.zeros(1, 1, dtype=torch.float64)], dim=1)
    torch.testing.assert_close(advantages, rewards + 0.99 * next_values - values, rtol=1e-9, atol=1e-9)


def test_seed_004_gae_with_gamma_and_lambda_one_is_monte_carlo_advantage():
    rewards, values, mask = seed_episode()
    advantages, returns = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(advantages, discounted_returns(rewards, 1.0) - values, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(returns, discounted_returns(rewards, 1.0), rtol=1e-9, atol=1e-9)


def test_seed_004_kl_folded_into_reward_shifts_return_by_discounted_kl():
    rewards, _, mask = seed_episode()
    kl = torch.rand(1, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    zeros = torch.zeros(1, 8, dtype=torch.float64)
    # The seed's identity on raw per-token rewards: returns(r - beta*kl) = returns(r) - returns(beta*kl).
    _, shaped_returns = compute_gae(rewards - 0.1 * kl, zeros, mask, gamma=1.0, lam=1.0)
    expected = discounted_returns(rewards, 1.0) - discounted_returns(0.1 * kl, 1.0)
    torch.testing.assert_close(shaped_returns, expected, rtol=1e-9, atol=1e-9)
    # The same through shape_rewards: a score of 2 at the end, minus the discounted KL sum.
    shaped, _ = shape_rewards(torch.tensor([2.0], dtype=torch.float64), kl, 0.1, mask)
    _, returns = compute_gae(shaped, zeros, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(returns, 2.0 - discounted_returns(0.1 * kl, 1.0), rtol=1e-9, atol=1e-9)


def test_seed_004_gae_differs_from_off_by_one_critic():
    rewards, values, mask = seed_episode()

    def off_by_one_gae(gamma, lam):
        out, advantage = [], 0.0
        for r, v in zip(reversed(rewards[0].tolist()), reversed(values[0].tolist())):
            advantage = (r + gamma * v - v) + gamma * lam * advantage  # V_t where V_{t+1} belongs
            out.append(advantage)
        return torch.tensor([out[::-1]], dtype=torch.float64)

    advantages, _ = compute_gae(rewards, values, mask, gamma=0.99, lam=0.95)
    assert not torch.allclose(off_by_one_gae(0.99, 0.95), advantages)
