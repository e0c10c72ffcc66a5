import pytest
import torch

from ppo_cli.algo.group import (
    GroupRewardStats,
    group_normalized_advantages,
    group_reward_stats,
    grouped,
    rloo_advantages,
)

TOL = dict(rtol=1e-6, atol=1e-6)

# Two prompts, G = 4: prompt 0 scored [1, 2, 3, 6] (mean 3), prompt 1 all 5 (a group with no signal).
SCORES = torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0, 5.0, 5.0, 5.0], dtype=torch.float64)


def test_grouped_views_contiguous_completions_as_rows():
    assert grouped(SCORES, 4).tolist() == [[1.0, 2.0, 3.0, 6.0], [5.0, 5.0, 5.0, 5.0]]


def test_group_normalized_advantages_group_scaling_matches_hand_computed_case():
    # centred [-2, -1, 0, 3]; Bessel std sqrt(14 / 3) = 2.160246899; the constant group gets 0
    expected = torch.tensor([-0.9258200998, -0.4629100499, 0.0, 1.3887301497, 0, 0, 0, 0], dtype=torch.float64)
    torch.testing.assert_close(group_normalized_advantages(SCORES, 4, "group", eps=0.0), expected, **TOL)


def test_group_normalized_advantages_adds_eps_to_the_std():
    # default eps 1e-4 (TRL's): centred / (2.160246899 + 1e-4)
    expected = torch.tensor([-0.9257772446, -0.4628886223, 0.0, 1.3886658669, 0, 0, 0, 0], dtype=torch.float64)
    torch.testing.assert_close(group_normalized_advantages(SCORES, 4), expected, **TOL)


def test_group_normalized_advantages_batch_scaling_divides_by_the_std_of_all_scores():
    # batch mean 4, squared deviations 9+4+1+4+1+1+1+1 = 22, std sqrt(22 / 7) = 1.772810521
    expected = torch.tensor([-1.1281521496, -0.5640760748, 0.0, 1.6922282245, 0, 0, 0, 0], dtype=torch.float64)
    torch.testing.assert_close(group_normalized_advantages(SCORES, 4, "batch", eps=0.0), expected, **TOL)


def test_group_normalized_advantages_none_is_dr_grpo_mean_centring():
    expected = torch.tensor([-2.0, -1.0, 0.0, 3.0, 0, 0, 0, 0], dtype=torch.float64)
    torch.testing.assert_close(group_normalized_advantages(SCORES, 4, "none"), expected, rtol=0, atol=0)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_all_equal_scores_give_exactly_zero_advantage_without_nan(scale_rewards):
    # 3 x 0.1 / 3 = 0.10000000000000002 != 0.1: an arithmetic mean would leave 1e-17, scaled by 1 / eps
    scores = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.1, 0.1], dtype=torch.float64)
    advantages = group_normalized_advantages(scores, 3, scale_rewards, eps=0.0)
    assert advantages.tolist() == [0.0] * 6


def test_rloo_advantages_match_hand_computed_leave_one_out_baselines():
    # completion 0: 1 - (2 + 3 + 6) / 3 = -8/3; 1: 2 - 10/3 = -4/3; 2: 3 - 3 = 0; 3: 6 - 2 = 4
    expected = torch.tensor([-8 / 3, -4 / 3, 0.0, 4.0, 0, 0, 0, 0], dtype=torch.float64)
    torch.testing.assert_close(rloo_advantages(SCORES, 4), expected, **TOL)


def test_rloo_is_g_over_g_minus_one_times_mean_centring():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(15, generator=generator, dtype=torch.float64)
    torch.testing.assert_close(rloo_advantages(scores, 5), 5 / 4 * group_normalized_advantages(scores, 5, "none"))


def test_rloo_with_two_completions_is_the_score_difference():
    scores = torch.tensor([3.0, 1.0])
    torch.testing.assert_close(rloo_advantages(scores, 2), torch.tensor([2.0, -2.0]), **TOL)


def test_group_reward_stats_match_hand_computed_case():
    stats = group_reward_stats(SCORES, 4)
    assert isinstance(stats, GroupRewardStats)
    torch.testing.assert_close(stats.group_std, torch.tensor([2.1602468995, 0.0], dtype=torch.float64), **TOL)
    # mean of the two group stds; one group of two has zero spread
    torch.testing.assert_close(stats.reward_std, torch.tensor(1.0801234497, dtype=torch.float64), **TOL)
    assert stats.frac_reward_zero_std.item() == 0.5


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: group_normalized_advantages(SCORES, 1), "group_size must be >= 2"),
        (lambda: rloo_advantages(SCORES, 1), "group_size must be >= 2"),
        (lambda: group_reward_stats(SCORES, 3), "scores must be (B,) with B a multiple of group_size=3, got shape (8,)"),
        (lambda: rloo_advantages(SCORES.view(2, 4), 4), "scores must be (B,) with B a multiple of group_size=4, got shape (2, 4)"),
        (lambda: group_normalized_advantages(SCORES, 4, "std"), "unknown scale_rewards 'std'; expected one of group, batch, none"),
    ],
)
def test_group_functions_reject_bad_groups_in_one_line(call, message):
    with pytest.raises(ValueError) as error:
        call()
    assert message in str(error.value) and "\n" not in str(error.value)


def test_group_functions_do_not_mutate_scores():
    scores = SCORES.clone()
    group_normalized_advantages(scores, 4)
    rloo_advantages(scores, 4)
    group_reward_stats(scores, 4)
    assert torch.equal(scores, SCORES)


def test_informative_groups_keep_the_groups_that_scored_apart():
    from ppo_cli.algo.group import informative_groups

    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.3, 0.3, 0.3 + 1e-7, 5.0, 5.0, 5.0])
    # groups of 3: all 1 / 0,1,0 / 0.3,0.3,0.3+1e-7 (apart, however little) / all 5
    assert informative_groups(scores, 3).tolist() == [False, True, True, False]
    scored = torch.tensor([True] * 3 + [True, False, True] + [True] * 6)
    assert informative_groups(scores, 3, scored).tolist() == [False, False, True, False]  # a lost reward: dropped
    # equal floats whose mean is not themselves (3 x 0.1 / 3 != 0.1) are still one score
    assert informative_groups(torch.tensor([0.1, 0.1, 0.1]), 3).tolist() == [False]
