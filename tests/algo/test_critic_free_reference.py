"""Randomised equivalence of the critic-free estimators against tests/algo/numpy_reference.py.

Random group sizes and prompt counts, scores drawn from a few integers (so tied and all-equal groups
occur), masks with empty rows, and truncated rows (full length, ``finished`` False) dropped by
``mask_truncated_completions``. Every torch function must match the plain numpy loops to 1e-6.
"""

import numpy as np
import pytest
import torch

from ppo_cli.algo.advantages import shape_rewards
from ppo_cli.algo.aggregation import LOSS_AGG_MODES, aggregate_loss
from ppo_cli.algo.group import group_normalized_advantages, group_reward_stats, rloo_advantages
from ppo_cli.algo.kl import kl_penalty
from ppo_cli.algo.losses import clipped_policy_loss, clipped_surrogate
from ppo_cli.algo.masking import mask_truncated_completions
from ppo_cli.algo.reinforce import reinforce_plus_plus_advantages, reinforce_plus_plus_baseline_advantages
from tests.algo import numpy_reference as ref

SEEDS = range(8)
TOL = 1e-6


def random_batch(seed):
    """A random GRPO-shaped batch; row lengths include 0 and T, and every T-long row may be truncated."""
    rng = np.random.default_rng(seed)
    group_size, prompts, length = int(rng.integers(2, 7)), int(rng.integers(1, 5)), int(rng.integers(1, 9))
    batch = group_size * prompts
    lengths = rng.integers(0, length + 1, size=batch)
    lengths[0] = length  # at least one real token, and one row at full length
    finished = (lengths < length) | (rng.random(batch) < 0.5)  # only full-length rows can be truncated
    finished[0] = True
    scores = rng.integers(-2, 3, size=batch).astype(np.float64) * rng.choice([1.0, 0.1])
    scores[-group_size:] = scores[-1]  # an all-equal group (the only group when P = 1)
    return dict(
        group_size=group_size,
        scores=scores,
        kl=rng.random((batch, length)),
        logprobs=-3 * rng.random((batch, length)),
        old_logprobs=-3 * rng.random((batch, length)),
        advantages=rng.standard_normal((batch, length)),
        per_token_loss=rng.standard_normal((batch, length)),
        mask=np.arange(length)[None, :] < lengths[:, None],
        finished=finished,
    )


def t(array):
    return torch.from_numpy(np.asarray(array))


def close(got, want):
    np.testing.assert_allclose(np.asarray(got.detach() if isinstance(got, torch.Tensor) else got, dtype=np.float64),
                               np.asarray(want, dtype=np.float64), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_group_normalized_advantages_match_reference(seed, scale_rewards):
    b = random_batch(seed)
    got = group_normalized_advantages(t(b["scores"]), b["group_size"], scale_rewards)
    close(got, ref.group_advantages(b["scores"], b["group_size"], scale_rewards, 1e-4))


@pytest.mark.parametrize("seed", SEEDS)
def test_rloo_and_group_stats_match_reference(seed):
    b = random_batch(seed)
    close(rloo_advantages(t(b["scores"]), b["group_size"]), ref.rloo_advantages(b["scores"], b["group_size"]))
    stats = group_reward_stats(t(b["scores"]), b["group_size"])
    group_std, reward_std, frac_zero = ref.group_reward_stats(b["scores"], b["group_size"])
    close(stats.group_std, group_std)
    close(stats.reward_std, reward_std)
    close(stats.frac_reward_zero_std, frac_zero)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_and_baseline_match_reference(seed, gamma):
    b = random_batch(seed)
    mask = t(b["mask"])
    rewards, non_score_rewards = shape_rewards(t(b["scores"]), t(b["kl"]), 0.05, mask)
    advantages, returns = reinforce_plus_plus_advantages(rewards, mask, gamma=gamma)
    want_advantages, want_returns = ref.reinforce_plus_plus(b["scores"], b["kl"], 0.05, b["mask"], gamma)
    close(advantages, want_advantages)
    close(returns, want_returns)
    advantages, returns = reinforce_plus_plus_baseline_advantages(t(b["scores"]), non_score_rewards, mask,
                                                                  b["group_size"], gamma)
    want_advantages, want_returns = ref.reinforce_plus_plus_baseline(b["scores"], b["kl"], 0.05, b["mask"],
                                                                     b["group_size"], gamma)
    close(advantages, want_advantages)
    close(returns, want_returns)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregations_match_reference_with_truncated_rows_masked(seed, mode):
    b = random_batch(seed)
    mask = mask_truncated_completions(t(b["mask"]), t(b["finished"]))
    np.testing.assert_array_equal(mask.numpy(), ref.mask_truncated(b["mask"], b["finished"]))
    max_length = b["mask"].shape[1] + 3
    got = aggregate_loss(t(b["per_token_loss"]), mask, mode, max_length)
    close(got, ref.aggregate(b["per_token_loss"], mask.numpy(), mode, max_length))


@pytest.mark.parametrize("seed", SEEDS)
def test_clipped_surrogate_matches_reference_per_token(seed):
    b = random_batch(seed)
    ratio = np.exp(b["logprobs"] - b["old_logprobs"])
    out = clipped_surrogate(t(ratio), t(b["advantages"]), 0.2, 0.28)
    for index in np.ndindex(ratio.shape):
        loss, low, high = ref.clipped_surrogate(ratio[index], b["advantages"][index], 0.2, 0.28)
        close(out.per_token[index], loss)
        assert (out.clipped_low[index].item(), out.clipped_high[index].item()) == (low, high)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_clipped_policy_loss_matches_reference(seed, ratio_level, mode):
    b = random_batch(seed)
    mask = mask_truncated_completions(t(b["mask"]), t(b["finished"]))
    max_length = b["mask"].shape[1]
    out = clipped_policy_loss(t(b["logprobs"]), t(b["old_logprobs"]), t(b["advantages"]), mask, 0.2,
                              cliprange_high=0.28, ratio_level=ratio_level, loss_agg_mode=mode,
                              max_response_length=max_length)
    loss, clipfrac, low, high = ref.policy_loss(b["logprobs"], b["old_logprobs"], b["advantages"], mask.numpy(),
                                                0.2, 0.28, ratio_level, mode, max_length)
    close(out.loss, loss)
    close(out.clipfrac, clipfrac)
    close(out.clipfrac_low, low)
    close(out.clipfrac_high, high)


@pytest.mark.parametrize("seed", SEEDS)
def test_k3_matches_reference(seed):
    b = random_batch(seed)
    close(kl_penalty(t(b["logprobs"]), t(b["old_logprobs"]), "k3"), ref.k3(b["logprobs"], b["old_logprobs"]))
