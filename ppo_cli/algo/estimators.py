"""The advantage estimators behind one signature, by the name ``ppo.advantage`` gives them.

Every estimator turns a rollout's sequence scores and per-token KL into per-token rewards, advantages
and returns, counting the action tokens only (``action_mask``, which may have holes: see
``advantages``'s docstring). One signature for all (``Estimator``), so the trainer calls
``ESTIMATORS[name]`` and knows no estimator by name. Adding one: a module with a function of that
signature (``estimate.Estimator``, returning ``estimate.Estimate``) and one line in ``ESTIMATORS``; the
schema's ``ppo.advantage`` Literal must list the same names (tests/test_kind_names.py), and
``recipe.CRITIC_FREE`` those that read no values.

Each rule lives in one place: reward shaping in ``advantages.shape_rewards`` (called once per
estimator), GRPO's epsilon and batch std in ``group``, whitening in ``masking.masked_whiten``.

Shapes: B batch, T response length.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from .advantages import compute_gae, shape_rewards
from .estimate import Estimate, Estimator, EstimatorSettings, ReduceSum
from .group import group_normalized_advantages, rloo_advantages
from .masking import masked_whiten
from .reinforce import reinforce_plus_plus_advantages, reinforce_plus_plus_baseline_advantages

def gae(scores: Tensor, kl: Tensor, values: Optional[Tensor], action_mask: Tensor,
        settings: EstimatorSettings, reduce_sum: Optional[ReduceSum] = None) -> Estimate:
    """PPO with a critic: shaped rewards (whitened, mean kept, if whiten_rewards), GAE over the action
    tokens with gamma and lam, advantages whitened if whiten_advantages. returns = raw advantages + V.

    Raises:
        ValueError: ``values`` is None (gae needs a critic).
    """
    if values is None:
        raise ValueError("the gae estimator needs the critic's values, got None (value.kind none)")
    rewards, non_score_rewards = shape_rewards(scores, kl, settings.kl_coef, action_mask)
    if settings.whiten_rewards:
        rewards = masked_whiten(rewards, action_mask, keep_mean=True, reduce_sum=reduce_sum)
    advantages, returns = compute_gae(rewards, values, action_mask, settings.gamma, settings.lam)
    if settings.whiten_advantages:
        advantages = masked_whiten(advantages, action_mask, reduce_sum=reduce_sum)
    return Estimate(rewards, non_score_rewards, advantages, returns)


def _sequence_rewards(scores: Tensor, kl: Tensor, action_mask: Tensor, settings: EstimatorSettings):
    """(rewards, non_score_rewards, sequence_rewards (B,)): grpo and rloo put the KL summed over the
    action tokens into the sequence reward (TRL's RLOO: rlhf_reward = score - kl_coef * kl.sum)."""
    rewards, non_score_rewards = shape_rewards(scores, kl, settings.kl_coef, action_mask)
    return rewards, non_score_rewards, scores + non_score_rewards.sum(dim=1)


def _on_action_tokens(sequence: Tensor, action_mask: Tensor, like: Tensor) -> Tensor:
    """(B,) -> (B, T): each sequence's advantage on its action tokens, 0 elsewhere."""
    return (sequence.unsqueeze(1) * action_mask).to(like.dtype)


def grpo(scores: Tensor, kl: Tensor, values: Optional[Tensor], action_mask: Tensor,
         settings: EstimatorSettings, reduce_sum: Optional[ReduceSum] = None) -> Estimate:
    """GRPO / Dr. GRPO (``group.group_normalized_advantages`` with scale_rewards): one advantage per
    sequence on each of its action tokens; returns = advantages. Groups are whole on each process, so
    only scale_rewards "batch" reads the other processes (through reduce_sum)."""
    rewards, non_score_rewards, sequence_rewards = _sequence_rewards(scores, kl, action_mask, settings)
    sequence = group_normalized_advantages(sequence_rewards, settings.group_size, settings.scale_rewards,
                                           reduce_sum=reduce_sum)
    advantages = _on_action_tokens(sequence, action_mask, rewards)
    return Estimate(rewards, non_score_rewards, advantages, advantages)


def rloo(scores: Tensor, kl: Tensor, values: Optional[Tensor], action_mask: Tensor,
         settings: EstimatorSettings, reduce_sum: Optional[ReduceSum] = None) -> Estimate:
    """RLOO (``group.rloo_advantages``): one advantage per sequence on each of its action tokens;
    returns = advantages. Reads only its own groups: reduce_sum is not needed."""
    rewards, non_score_rewards, sequence_rewards = _sequence_rewards(scores, kl, action_mask, settings)
    advantages = _on_action_tokens(rloo_advantages(sequence_rewards, settings.group_size), action_mask, rewards)
    return Estimate(rewards, non_score_rewards, advantages, advantages)


def reinforce_pp(scores: Tensor, kl: Tensor, values: Optional[Tensor], action_mask: Tensor,
                 settings: EstimatorSettings, reduce_sum: Optional[ReduceSum] = None) -> Estimate:
    """REINFORCE++ (``reinforce``): discounted returns of the shaped rewards, whitened over the batch;
    with group_size > 1 the group mean of the scores is subtracted first (REINFORCE++-baseline).
    ``rewards`` holds the raw scores either way; returns are before whitening."""
    rewards, non_score_rewards = shape_rewards(scores, kl, settings.kl_coef, action_mask)
    if settings.group_size > 1:
        advantages, returns = reinforce_plus_plus_baseline_advantages(
            scores, non_score_rewards, action_mask, settings.group_size, settings.gamma, reduce_sum)
    else:
        advantages, returns = reinforce_plus_plus_advantages(rewards, action_mask, settings.gamma, reduce_sum)
    return Estimate(rewards, non_score_rewards, advantages, returns)


ESTIMATORS: dict[str, Estimator] = {
    "gae": gae,
    "grpo": grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
}
