"""The advantage estimators behind one signature, by the name ``ppo.advantage`` gives them.

Every estimator turns a rollout's sequence scores and per-token KL into per-token rewards, advantages
and returns, counting the action tokens only (``action_mask``, which may have holes: see
``advantages``'s docstring). One signature for all (``Estimator``), so the trainer calls
``ESTIMATORS[name]`` and knows no estimator by name. Adding one: a function of that signature (in its
own module when it brings new maths) and one line in ``ESTIMATORS``; the schema's ``ppo.advantage``
Literal must list the same names (tests/test_kind_names.py).

Each rule lives in one place: reward shaping in ``advantages.shape_rewards`` (called once per
estimator), GRPO's epsilon and batch std in ``group``, whitening in ``masking.masked_whiten``.

Shapes: B batch, T response length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Protocol, Union

from torch import Tensor

from .advantages import compute_gae, shape_rewards
from .group import group_normalized_advantages, rloo_advantages
from .masking import masked_whiten
from .reinforce import reinforce_plus_plus_advantages, reinforce_plus_plus_baseline_advantages

ReduceSum = Callable[[Tensor], Tensor]  # a tensor -> its elementwise sum over every process


@dataclass(frozen=True)
class EstimatorSettings:
    """The knobs the estimators read; each reads the ones its docstring names.

    kl_coef: beta on the per-token KL in the reward; 0 when the KL goes into the loss instead.
    gamma: discount per action token (gae, reinforce_pp).
    lam: GAE lambda (gae).
    whiten_rewards: whiten the shaped rewards, mean kept, before GAE (gae).
    whiten_advantages: whiten GAE's advantages (gae; reinforce_pp always whitens).
    scale_rewards: "group", "batch" or "none", what GRPO divides by (grpo).
    group_size: G, completions per prompt, contiguous (grpo, rloo; reinforce_pp subtracts the group
        mean when G > 1).
    """

    kl_coef: Union[float, Tensor] = 0.0
    gamma: float = 1.0
    lam: float = 0.95
    whiten_rewards: bool = False
    whiten_advantages: bool = True
    scale_rewards: str = "group"
    group_size: int = 1


class Estimate(NamedTuple):
    """An estimator's output, every field (B, T) and 0 outside the action mask.

    rewards: shaped per-token rewards (KL penalty + score on the last action token).
    non_score_rewards: the KL part alone.
    advantages: what the policy loss multiplies.
    returns: the value target (gae: advantages + values); critic-free: as their docstrings say.
    """

    rewards: Tensor
    non_score_rewards: Tensor
    advantages: Tensor
    returns: Tensor


class Estimator(Protocol):
    def __call__(self, scores: Tensor, kl: Tensor, values: Optional[Tensor], action_mask: Tensor,
                 settings: EstimatorSettings, reduce_sum: Optional[ReduceSum] = None) -> Estimate:
        """scores (B,), kl (B, T), values (B, T) or None without a critic, action_mask bool (B, T) with
        holes allowed; reduce_sum sums across processes (None for one), so that every statistic taken
        over the batch (whitening, GRPO's batch std) is the whole distributed batch's."""


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
