"""compute_advantages for the critic-free estimators, on a hand-made rollout of 2 prompts x 2 completions."""

from __future__ import annotations

import math

import pytest
import torch

from ppo_cli.algo.advantages import shape_rewards
from ppo_cli.algo.reinforce import reinforce_plus_plus_advantages, reinforce_plus_plus_baseline_advantages
from ppo_cli.recipe import PPOConfig
from ppo_cli.engine.data import PromptSampler
from ppo_cli.trainer import compute_advantages, process_prompts
from ppo_cli.types import Generation, Rollout

LENGTHS = [3, 1, 2, 3]  # prompt 0: completions 0, 1; prompt 1: completions 2, 3
SCORES = [1.0, 3.0, 2.0, 2.0]  # prompt 1's two completions score the same


def rollout(log_ratio: float = 0.2) -> Rollout:
    mask = torch.tensor([[t < n for t in range(3)] for n in LENGTHS])
    ref = torch.full((4, 3), -1.0).masked_fill(~mask, 0.0)
    logprobs = (ref + log_ratio).masked_fill(~mask, 0.0)  # k1 KL of 0.2 on every real token
    ids = torch.ones(4, 3, dtype=torch.long)
    generation = Generation(ids[:, :1], torch.ones(4, 1, dtype=torch.bool), ids, mask, torch.ones(4, dtype=torch.bool), mask)
    return Rollout(generation, ["a", "a", "b", "b"], [""] * 4, logprobs, ref, None, torch.tensor(SCORES), {})


def per_token(sequence: list[float]) -> torch.Tensor:
    mask = rollout().generation.response_mask
    return torch.tensor(sequence).unsqueeze(1) * mask


def test_grpo_divides_by_the_group_std_and_keeps_the_kl_out_of_the_reward():
    ppo = PPOConfig(advantage="grpo", kl_coef=0.5)  # kl_penalty auto: the loss
    adv = compute_advantages(rollout(), 0.5, ppo, group_size=2)
    a = 1.0 / (math.sqrt(2.0) + 1e-4)  # (3 - 2) / (std of [1, 3] = sqrt 2, Bessel) + TRL's eps
    torch.testing.assert_close(adv.advantages, per_token([-a, a, 0.0, 0.0]))
    assert adv.non_score_rewards.abs().sum() == 0  # the KL goes into the loss instead
    torch.testing.assert_close(adv.kl.sum(dim=1), torch.tensor([0.6, 0.2, 0.4, 0.6]))  # still measured


def test_dr_grpo_only_centres():
    adv = compute_advantages(rollout(), 0.5, PPOConfig(advantage="grpo", scale_rewards="none"), group_size=2)
    torch.testing.assert_close(adv.advantages, per_token([-1.0, 1.0, 0.0, 0.0]))


def test_rloo_subtracts_the_summed_kl_then_the_others_mean():
    adv = compute_advantages(rollout(), 0.5, PPOConfig(advantage="rloo"), group_size=2)
    # rewards: score - 0.5 x KL summed = [1 - 0.3, 3 - 0.1, 2 - 0.2, 2 - 0.3] = [0.7, 2.9, 1.8, 1.7]
    torch.testing.assert_close(adv.advantages, per_token([0.7 - 2.9, 2.9 - 0.7, 1.8 - 1.7, 1.7 - 1.8]))
    torch.testing.assert_close(adv.non_score_rewards, -0.5 * 0.2 * rollout().generation.response_mask.float())


def test_grpo_with_the_kl_in_the_reward_ranks_by_the_shaped_reward():
    adv = compute_advantages(rollout(), 0.5, PPOConfig(advantage="grpo", kl_penalty="reward"), group_size=2)
    # shaped rewards [0.7, 2.9] and [1.8, 1.7]: 1.1 and 0.05 from their means, stds 2.2 / sqrt 2 and 0.1 / sqrt 2
    a, b = 1.1 / (2.2 / math.sqrt(2.0) + 1e-4), 0.05 / (0.1 / math.sqrt(2.0) + 1e-4)
    torch.testing.assert_close(adv.advantages, per_token([-a, a, b, -b]))


@pytest.mark.parametrize("group_size", [1, 2])
def test_reinforce_pp_is_the_algo_function_with_the_group_baseline_from_two_completions(group_size):
    r = rollout()
    adv = compute_advantages(r, 0.5, PPOConfig(advantage="reinforce_pp"), group_size=group_size)
    mask = r.generation.response_mask
    rewards, non_score_rewards = shape_rewards(r.scores, adv.kl, 0.5, mask)
    if group_size == 1:
        expected, returns = reinforce_plus_plus_advantages(rewards, mask)
    else:
        expected, returns = reinforce_plus_plus_baseline_advantages(r.scores, non_score_rewards, mask, 2)
    torch.testing.assert_close(adv.advantages, expected)
    torch.testing.assert_close(adv.returns, returns)
    if group_size == 2:  # returns of the centred score: prompt 1's rows hold only the KL part
        torch.testing.assert_close(returns[2], torch.tensor([-0.2, -0.1, 0.0]))


def test_gae_with_the_kl_in_the_loss_keeps_it_out_of_the_reward():
    r = rollout()._replace(values=torch.zeros(4, 3))
    adv = compute_advantages(r, 0.5, PPOConfig(kl_penalty="loss", whiten_advantages=False))
    assert adv.non_score_rewards.abs().sum() == 0
    torch.testing.assert_close(adv.rewards.sum(dim=1), torch.tensor(SCORES))


def test_grpo_batch_scale_across_processes_uses_every_process_scores():
    """Two processes holding the same batch: the global std over 8 scores, not the local one over 4."""
    r = rollout()
    ppo = PPOConfig(advantage="grpo", scale_rewards="batch")
    local = compute_advantages(r, 0.5, ppo, group_size=2)
    doubled = compute_advantages(r, 0.5, ppo, reduce_sum=lambda t: 2 * t, group_size=2)
    scores = torch.tensor(SCORES)
    std_local, std_global = scores.std().item(), torch.cat([scores, scores]).std().item()
    assert local.advantages[1, 0].item() == pytest.approx(1.0 / (std_local + 1e-4), rel=1e-6)
    assert doubled.advantages[1, 0].item() == pytest.approx(1.0 / (std_global + 1e-4), rel=1e-6)
    assert doubled.advantages[2:].abs().sum() == 0  # the constant group


def test_each_process_gets_whole_groups_of_its_own_prompts():
    prompts = [f"p{i}" for i in range(8)]
    draws = [process_prompts(PromptSampler(prompts, seed=0, shuffle=True), 2, rank, 2, 3) for rank in range(2)]
    for episodes in draws:
        assert len(episodes) == 6 and episodes[0:3] == [episodes[0]] * 3 and episodes[3:6] == [episodes[3]] * 3
    assert len({draws[0][0], draws[0][3], draws[1][0], draws[1][3]}) == 4  # no prompt on two processes
    assert process_prompts(PromptSampler(prompts, seed=0, shuffle=True), 4, 0, 1, 1) == \
        PromptSampler(prompts, seed=0, shuffle=True).next_batch(4)  # G = 1: the batch as drawn
