"""REINFORCE++ (Hu 2025, arXiv:2501.03262): token-level returns with the KL in the reward, whitened
over the whole batch, and its group-baseline variant. No critic.

Shapes: B batch, T response length; ``response_mask`` is bool and a prefix per row. Follows
OpenRLHF's ``advantage_estimator`` "reinforce" / "reinforce_baseline"
(openrlhf/trainer/ppo_utils/experience_maker.py: ``compute_reward`` puts -kl_coef * kl_t on every
token and the score on the last one, ``get_cumulative_returns`` sums them backwards, then the
advantages are normalised over all action tokens of the batch) and verl's
``compute_reinforce_plus_plus_outcome_advantage`` (verl/trainer/ppo/core_algos.py: discounted returns
reset after EOS, then ``masked_whiten``). The whitening is ``masking.masked_whiten`` (Bessel-corrected
variance + 1e-8 inside the rsqrt, as verl and TRL); OpenRLHF divides by the population variance
clamped at 1e-8, a factor sqrt((n-1)/n) apart for n real tokens.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple, Union

import torch
from torch import Tensor

from .advantages import compute_gae, shape_rewards
from .group import group_normalized_advantages
from .masking import masked_whiten


def discounted_returns(rewards: Tensor, response_mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Monte-Carlo return of every response token.

    return_t = sum_{s >= t, s real} gamma^(s - t) * r_s        (0 outside the mask)

    This is GAE with V = 0 and lambda = 1 (delta_t = r_t, A_t = r_t + gamma * A_{t+1}), so it reuses
    ``compute_gae`` and its masking.

    Args:
        rewards: (B, T) per-token rewards (``shape_rewards``).
        response_mask: bool, (B, T); a prefix per row.
        gamma: discount, 1.0 by default.

    Returns:
        (B, T) returns.
    """
    returns, _ = compute_gae(rewards, torch.zeros_like(rewards), response_mask, gamma, 1.0)
    return returns


def reinforce_plus_plus_advantages(
    scores: Tensor,
    kl: Tensor,
    kl_coef: Union[float, Tensor],
    response_mask: Tensor,
    gamma: float = 1.0,
    reduce_sum: Optional[Callable[[Tensor], Tensor]] = None,
) -> Tuple[Tensor, Tensor]:
    """REINFORCE++ advantages.

    r_t      = -kl_coef * kl_t + [t == last real token] * score          (``shape_rewards``)
    return_t = sum_{s >= t} gamma^(s - t) * r_s                           (``discounted_returns``)
    A_t      = (return_t - mean) / sqrt(var + 1e-8), mean and var over every real token of the batch

    Args:
        scores: (B,) sequence scores.
        kl: (B, T) per-token KL estimate (``kl_penalty``); it enters the reward, not the loss.
        kl_coef: beta.
        response_mask: bool, (B, T).
        gamma: discount, 1.0 by default.
        reduce_sum: with several processes, a sum across them, so the whitening statistics are those of
            the whole distributed batch (``masked_whiten``). None for one process.

    Returns:
        advantages: (B, T), 0 outside the mask.
        returns: (B, T), before whitening.

    Raises:
        ValueError: no real token in the batch (``masked_whiten``).
    """
    rewards, _ = shape_rewards(scores, kl, kl_coef, response_mask)
    returns = discounted_returns(rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask, reduce_sum=reduce_sum), returns


def reinforce_plus_plus_baseline_advantages(
    scores: Tensor,
    kl: Tensor,
    kl_coef: Union[float, Tensor],
    response_mask: Tensor,
    group_size: int,
    gamma: float = 1.0,
    reduce_sum: Optional[Callable[[Tensor], Tensor]] = None,
) -> Tuple[Tensor, Tensor]:
    """REINFORCE++-baseline: subtract the group mean of the scores, then REINFORCE++.

    score'_i = score_i - mean_group(score)     (``group_normalized_advantages(..., "none")``)
    then ``reinforce_plus_plus_advantages(score', ...)``: KL in the per-token reward, returns, whitened
    over the batch. As OpenRLHF's "reinforce_baseline". With kl_coef = 0 and gamma = 1 every token of
    row i gets score'_i before whitening, which is verl's ``compute_reinforce_plus_plus_baseline_outcome_advantage``
    (verl keeps the KL out of the reward, as a loss term).

    Args:
        scores: (B,) contiguous groups of ``group_size`` (layout in ``group``'s docstring).
        kl, kl_coef, response_mask, gamma, reduce_sum: as ``reinforce_plus_plus_advantages``.
        group_size: G >= 2.

    Returns:
        advantages (B, T), returns (B, T), as ``reinforce_plus_plus_advantages``.

    Raises:
        ValueError: bad ``group_size`` or shape (``group.grouped``), or no real token.
    """
    centred = group_normalized_advantages(scores, group_size, scale_rewards="none")
    return reinforce_plus_plus_advantages(centred, kl, kl_coef, response_mask, gamma, reduce_sum)
