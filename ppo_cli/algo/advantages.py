"""Per-token reward shaping and Generalized Advantage Estimation.

Shapes: B batch, T response length. ``response_mask`` is bool, True on real response tokens,
and is a prefix per row (True up to the last real token, False after it: right padding).
"""

from __future__ import annotations

from typing import Tuple, Union

import torch
from torch import Tensor


def last_token_index(response_mask: Tensor) -> Tensor:
    """Index of the last True entry of each row.

    last_token_index_b = max{t : response_mask[b, t]}, or 0 when the row has no True entry.

    Args:
        response_mask: bool, (B, T).

    Returns:
        LongTensor (B,).
    """
    positions = torch.arange(response_mask.shape[1], device=response_mask.device)  # (T,)
    # -1 loses every max() against a real position, so only empty rows reach the clamp.
    return torch.where(response_mask, positions, -1).max(dim=1).values.clamp(min=0)


def shape_rewards(
    scores: Tensor, kl: Tensor, kl_coef: Union[float, Tensor], response_mask: Tensor
) -> Tuple[Tensor, Tensor]:
    """Per-token RLHF reward: a KL penalty on every real token plus the score on the last one.

    non_score_rewards_t = -kl_coef * kl_t                      on real tokens, 0 elsewhere
    rewards_t = non_score_rewards_t + [t == last real token] * score

    TRL puts the score one position after the last real token when there is room
    (``sequence_lengths_p1``); here it sits on the last real token itself, so every reward lies
    inside ``response_mask`` and GAE needs no extra "+1" mask.

    Args:
        scores: (B,) per-sequence reward-model score.
        kl: (B, T) per-token KL estimate (``kl_penalty``).
        kl_coef: beta, the KL coefficient (the KL controller's ``value``).
        response_mask: bool, (B, T).

    Returns:
        rewards: (B, T).
        non_score_rewards: (B, T), the KL part alone (logged as TRL's ``objective/non_score_reward``).
        A row with no real token gets no score: all its rewards are 0.
    """
    non_score_rewards = torch.where(response_mask, -kl_coef * kl, 0)
    has_tokens = response_mask.any(dim=1)  # (B,)
    placed_scores = torch.where(has_tokens, scores, 0).to(non_score_rewards.dtype)  # (B,)
    rewards = non_score_rewards.scatter_add(
        1, last_token_index(response_mask).unsqueeze(1), placed_scores.unsqueeze(1)
    )
    return rewards, non_score_rewards


def compute_gae(
    rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float, lam: float
) -> Tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2015) over the response tokens.

    delta_t = r_t + gamma * V_{t+1} - V_t
    A_t     = delta_t + gamma * lam * A_{t+1}        (A_T = 0)
    R_t     = A_t + V_t

    Rewards and values outside ``response_mask`` are zeroed first: the episode ends at the last
    real token, so V after it is 0 and nothing past it is bootstrapped.

    Args:
        rewards: (B, T) shaped per-token rewards (``shape_rewards``).
        values: (B, T) critic values V(s_t) from the rollout.
        response_mask: bool, (B, T); a prefix per row.
        gamma: discount (1.0 in RLHF).
        lam: GAE lambda; 0 gives one-step TD, 1 gives Monte-Carlo returns minus V.

    Returns:
        advantages: (B, T), 0 outside the mask; not whitened (see ``masked_whiten``).
        returns: (B, T), advantages + values, 0 outside the mask (the value-loss target).
    """
    rewards = torch.where(response_mask, rewards, 0)
    values = torch.where(response_mask, values, 0)
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)  # (B, T)
    deltas = rewards + gamma * next_values - values  # (B, T)
    advantage = torch.zeros_like(deltas[:, 0])  # (B,)
    reversed_advantages = []
    # The recursion is sequential in t; vectorising over B is enough since T is a few hundred.
    for t in reversed(range(deltas.shape[1])):
        advantage = deltas[:, t] + gamma * lam * advantage
        reversed_advantages.append(advantage)
    advantages = torch.stack(reversed_advantages[::-1], dim=1)  # (B, T)
    advantages = torch.where(response_mask, advantages, 0)
    return advantages, torch.where(response_mask, advantages + values, 0)
