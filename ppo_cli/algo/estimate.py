"""What every advantage estimator takes and gives (the registry is ``estimators.ESTIMATORS``).

Apart from the registry so that an estimator in its own module imports these without a cycle.
Shapes: B batch, T response length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Protocol, Union

from torch import Tensor

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
