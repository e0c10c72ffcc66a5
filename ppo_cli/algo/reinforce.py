"""REINFORCE++ (Hu 2025, arXiv:2501.03262): token-level returns with the KL in the reward, whitened
over the whole batch, and its group-baseline variant. No critic.

Shapes: B batch, T response length; ``action_mask`` is bool and may have holes (the environment's
tokens of an episode with several turns): returns run over each row's action tokens as one sequence,
as ``compute_gae``. Follows OpenRLHF's ``advantage_estimator`` "reinforce" / "reinforce_baseline"
(openrlhf/trainer/ppo_utils/experience_maker.py: ``compute_reward`` puts -kl_coef * kl_t on every
token and the score on the last one, ``get_cumulative_returns`` sums them backwards, then the
advantages are normalised over all action tokens of the batch) and verl's
``compute_reinforce_plus_plus_outcome_advantage`` (verl/trainer/ppo/core_algos.py: discounted returns
reset after EOS, then ``masked_whiten``). The whitening is ``masking.masked_whiten`` (Bessel-corrected
variance + 1e-8 inside the rsqrt, as verl and TRL); OpenRLHF divides by the population variance
clamped at 1e-8, a factor sqrt((n-1)/n) apart for n action tokens.

The per-token rewards come in already shaped (``advantages.shape_rewards``): the shaping rule lives
there alone.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from .advantages import add_scores, compute_gae
from .group import group_normalized_advantages
from .masking import masked_whiten


def discounted_returns(rewards: Tensor, action_mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Monte-Carlo return of every action token.

    return_t = sum_{s >= t} gamma^(s - t) * r_s     over the row's action tokens, t and s counting them
                                                    (0 outside the mask)

    This is GAE with V = 0 and lambda = 1 (delta_t = r_t, A_t = r_t + gamma * A_{t+1}), so it reuses
    ``compute_gae``, its masking and its compaction of the holes.

    Args:
        rewards: (B, T) per-token rewards (``shape_rewards``).
        action_mask: bool, (B, T); may have holes.
        gamma: discount, 1.0 by default.

    Returns:
        (B, T) returns.
    """
    returns, _ = compute_gae(rewards, torch.zeros_like(rewards), action_mask, gamma, 1.0)
    return returns


def reinforce_plus_plus_advantages(
    rewards: Tensor,
    action_mask: Tensor,
    gamma: float = 1.0,
    reduce_sum: Optional[Callable[[Tensor], Tensor]] = None,
) -> Tuple[Tensor, Tensor]:
    """REINFORCE++ advantages from the shaped rewards.

    r_t      = -kl_coef * kl_t + [t == last action token] * score          (``shape_rewards``, by the caller)
    return_t = sum_{s >= t} gamma^(s - t) * r_s                             (``discounted_returns``)
    A_t      = (return_t - mean) / sqrt(var + 1e-8), mean and var over every action token of the batch

    Args:
        rewards: (B, T) shaped per-token rewards; the KL enters here, not the loss.
        action_mask: bool, (B, T); may have holes.
        gamma: discount, 1.0 by default.
        reduce_sum: with several processes, a sum across them, so the whitening statistics are those of
            the whole distributed batch (``masked_whiten``). None for one process.

    Returns:
        advantages: (B, T), 0 outside the mask.
        returns: (B, T), before whitening.

    Raises:
        ValueError: no action token in the batch (``masked_whiten``).
    """
    returns = discounted_returns(rewards, action_mask, gamma)
    return masked_whiten(returns, action_mask, reduce_sum=reduce_sum), returns


def reinforce_plus_plus_baseline_advantages(
    scores: Tensor,
    non_score_rewards: Tensor,
    action_mask: Tensor,
    group_size: int,
    gamma: float = 1.0,
    reduce_sum: Optional[Callable[[Tensor], Tensor]] = None,
) -> Tuple[Tensor, Tensor]:
    """REINFORCE++-baseline: subtract the group mean of the scores, then REINFORCE++.

    score'_i = score_i - mean_group(score)     (``group_normalized_advantages(..., "none")``)
    r_t      = non_score_rewards_t + [t == last action token] * score'    (``add_scores``)
    then ``reinforce_plus_plus_advantages``: returns, whitened over the batch. As OpenRLHF's
    "reinforce_baseline". With kl_coef = 0 and gamma = 1 every token of row i gets score'_i before
    whitening, which is verl's ``compute_reinforce_plus_plus_baseline_outcome_advantage`` (verl keeps
    the KL out of the reward, as a loss term).

    Args:
        scores: (B,) contiguous groups of ``group_size`` (layout in ``group``'s docstring).
        non_score_rewards: (B, T) the KL part of the shaped rewards (``shape_rewards``).
        action_mask, gamma, reduce_sum: as ``reinforce_plus_plus_advantages``.
        group_size: G >= 2.

    Returns:
        advantages (B, T), returns (B, T), as ``reinforce_plus_plus_advantages``.

    Raises:
        ValueError: bad ``group_size`` or shape (``group.grouped``), or no action token.
    """
    centred = group_normalized_advantages(scores, group_size, scale_rewards="none")
    rewards = add_scores(non_score_rewards, centred, action_mask)
    return reinforce_plus_plus_advantages(rewards, action_mask, gamma, reduce_sum)
