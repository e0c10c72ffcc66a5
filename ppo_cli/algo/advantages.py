"""Per-token reward shaping and Generalized Advantage Estimation.

Shapes: B batch, T response length. ``action_mask`` is bool, True on the policy's sampled tokens (the
ones trained). It may have holes: in an episode with several turns the environment's tokens sit
between the policy's, attended but not acted, e.g. [1, 1, 1, 0, 0, 1, 1, 0, ...]. With one turn it is
a prefix per row (True up to the last real token, False after it: right padding).

The estimators treat a row's action tokens as ONE sequence, the environment's segments cut out: the
recursion runs over the compacted row (``compact_order``), so gamma and lambda apply once per action
token and the last action token before an environment segment bootstraps from the value of the next
action token after it. Compacting a prefix mask is the identity, so one-turn results are unchanged to
the bit.
"""

from __future__ import annotations

from typing import Tuple, Union

import torch
from torch import Tensor


def last_token_index(action_mask: Tensor) -> Tensor:
    """Index of the last True entry of each row (holes before it do not matter).

    last_token_index_b = max{t : action_mask[b, t]}, or 0 when the row has no True entry.

    Args:
        action_mask: bool, (B, T).

    Returns:
        LongTensor (B,).
    """
    positions = torch.arange(action_mask.shape[1], device=action_mask.device)  # (T,)
    # -1 loses every max() against a real position, so only empty rows reach the clamp.
    return torch.where(action_mask, positions, -1).max(dim=1).values.clamp(min=0)


def compact_order(action_mask: Tensor) -> Tensor:
    """Per row, the positions of the action tokens in order, then the other positions in order.

    ``x.gather(1, order)`` moves each row's action tokens to the left (their order kept); ``uncompact``
    puts them back. A stable sort of ~action_mask, so a prefix mask gives arange(T) in every row and
    compacting it copies the tensor unchanged.

    Args:
        action_mask: bool, (B, T).

    Returns:
        LongTensor (B, T), a permutation of 0..T-1 in each row.
    """
    # uint8, not bool: sort's support for bool varies across devices.
    return torch.sort((~action_mask).to(torch.uint8), dim=1, stable=True).indices


def uncompact(compacted: Tensor, order: Tensor) -> Tensor:
    """Inverse of ``x.gather(1, order)``: entry j of each compacted row goes back to position order[b, j].

    Args:
        compacted: (B, T).
        order: (B, T) from ``compact_order``.

    Returns:
        (B, T).
    """
    return torch.empty_like(compacted).scatter(1, order, compacted)


def add_scores(non_score_rewards: Tensor, scores: Tensor, action_mask: Tensor) -> Tensor:
    """rewards_t = non_score_rewards_t + [t == last action token] * score; a row with no action token gets none.

    Args:
        non_score_rewards: (B, T), 0 outside the mask.
        scores: (B,) per-sequence score.
        action_mask: bool, (B, T).

    Returns:
        (B, T) rewards.
    """
    has_tokens = action_mask.any(dim=1)  # (B,)
    placed_scores = torch.where(has_tokens, scores, 0).to(non_score_rewards.dtype)  # (B,)
    return non_score_rewards.scatter_add(1, last_token_index(action_mask).unsqueeze(1), placed_scores.unsqueeze(1))


def shape_rewards(
    scores: Tensor, kl: Tensor, kl_coef: Union[float, Tensor], action_mask: Tensor
) -> Tuple[Tensor, Tensor]:
    """Per-token RLHF reward: a KL penalty on every action token plus the score on the last one.

    non_score_rewards_t = -kl_coef * kl_t                      on action tokens, 0 elsewhere
    rewards_t = non_score_rewards_t + [t == last action token] * score

    TRL puts the score one position after the last real token when there is room
    (``sequence_lengths_p1``); here it sits on the last action token itself, so every reward lies
    inside ``action_mask`` and GAE needs no extra "+1" mask. An environment's tokens (holes in the
    mask) get no reward: they were not the policy's choice.

    Args:
        scores: (B,) per-sequence reward-model score.
        kl: (B, T) per-token KL estimate (``kl_penalty``).
        kl_coef: beta, the KL coefficient (the KL controller's ``value``).
        action_mask: bool, (B, T); may have holes.

    Returns:
        rewards: (B, T).
        non_score_rewards: (B, T), the KL part alone (logged as TRL's ``objective/non_score_reward``).
        A row with no action token gets no score: all its rewards are 0.
    """
    non_score_rewards = torch.where(action_mask, -kl_coef * kl, 0)
    return add_scores(non_score_rewards, scores, action_mask), non_score_rewards


def compute_gae(
    rewards: Tensor, values: Tensor, action_mask: Tensor, gamma: float, lam: float
) -> Tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2015) over each row's action tokens.

    On the compacted row (action tokens only, in order; t indexes them):
    delta_t = r_t + gamma * V_{t+1} - V_t
    A_t     = delta_t + gamma * lam * A_{t+1}        (A after the last action token = 0)
    R_t     = A_t + V_t
    then scattered back to the tokens' positions. So the last action token before an environment
    segment bootstraps from the value of the first action token after it, and gamma and lambda
    apply once per action token, not per position.

    Rewards and values outside ``action_mask`` are zeroed first: the episode ends at the last
    action token, so V after it is 0 and nothing past it is bootstrapped.

    Args:
        rewards: (B, T) shaped per-token rewards (``shape_rewards``).
        values: (B, T) critic values V(s_t) from the rollout.
        action_mask: bool, (B, T); may have holes.
        gamma: discount (1.0 in RLHF).
        lam: GAE lambda; 0 gives one-step TD, 1 gives Monte-Carlo returns minus V.

    Returns:
        advantages: (B, T), 0 outside the mask; not whitened (see ``masked_whiten``).
        returns: (B, T), advantages + values, 0 outside the mask (the value-loss target).
    """
    order = compact_order(action_mask)  # (B, T); identity for a prefix mask
    mask = action_mask.gather(1, order)  # (B, T), a prefix per row
    rewards = torch.where(mask, rewards.gather(1, order), 0)
    values = torch.where(mask, values.gather(1, order), 0)
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)  # (B, T)
    deltas = rewards + gamma * next_values - values  # (B, T)
    advantage = torch.zeros_like(deltas[:, 0])  # (B,)
    reversed_advantages = []
    # The recursion is sequential in t; vectorising over B is enough since T is a few hundred.
    for t in reversed(range(deltas.shape[1])):
        advantage = deltas[:, t] + gamma * lam * advantage
        reversed_advantages.append(advantage)
    advantages = torch.stack(reversed_advantages[::-1], dim=1)  # (B, T)
    advantages = torch.where(mask, advantages, 0)
    returns = torch.where(mask, advantages + values, 0)
    return uncompact(advantages, order), uncompact(returns, order)
