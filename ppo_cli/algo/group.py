"""Critic-free baselines from a group of completions of one prompt: GRPO, Dr. GRPO and RLOO.

Layout: ``scores`` is (B,) with B = P x G, the G completions of each prompt contiguous:
[prompt 0: completions 0..G-1, prompt 1: completions 0..G-1, ...]. This is the layout of TRL's
GRPOTrainer (each prompt repeated G times in a row, ``rewards.view(-1, num_generations)``) and of
OpenRLHF (``rewards.reshape(-1, n_samples_per_prompt)``). P prompts, G = ``group_size``.

The advantages are per sequence, (B,); the caller broadcasts them over the response tokens
(``advantages.unsqueeze(1)`` masked by the action mask), as verl's ``compute_grpo_outcome_advantage``
and ``compute_rloo_outcome_advantage`` (verl/trainer/ppo/core_algos.py) do.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from .masking import global_masked_mean_var

SCALE_REWARDS = ("group", "batch", "none")
GRPO_EPS = 1e-4  # added to the std GRPO divides by: TRL's epsilon (verl's is 1e-6)


class GroupRewardStats(NamedTuple):
    """Spread of the scores within each group, for logging; no grad.

    group_std: (P,) std of each group's scores, Bessel-corrected (torch.std's default, as TRL).
    reward_std: () mean of ``group_std`` over the groups (TRL's ``reward_std`` with scale_rewards "group").
    frac_reward_zero_std: () fraction of groups whose G scores are all equal (TRL's ``frac_reward_zero_std``);
        those groups give every completion advantage 0, so they carry no learning signal.
    """

    group_std: Tensor
    reward_std: Tensor
    frac_reward_zero_std: Tensor


def grouped(scores: Tensor, group_size: int) -> Tensor:
    """View the (B,) scores as (P, G), one row per prompt.

    Raises:
        ValueError: ``group_size`` < 2 (one completion has nothing to compare against), or ``scores``
            is not 1-D with a length divisible by ``group_size``.
    """
    if group_size < 2:
        raise ValueError(
            f"group_size must be >= 2 (a baseline needs another completion of the prompt), got {group_size}"
        )
    if scores.dim() != 1 or scores.numel() % group_size != 0:
        raise ValueError(
            f"scores must be (B,) with B a multiple of group_size={group_size}, got shape {tuple(scores.shape)}"
        )
    return scores.view(-1, group_size)


def _constant_groups(groups: Tensor) -> Tensor:
    """(P, 1) bool: True where every score of the group is equal.

    Tested exactly (max == min) rather than through the std: the mean of equal floats can differ from
    them in the last bit (3 x 0.1 / 3 != 0.1), which would leave a 1e-17 "advantage" instead of 0.
    """
    return (groups.amax(dim=1, keepdim=True) == groups.amin(dim=1, keepdim=True))


def batch_std(scores: Tensor, reduce_sum: Optional[Callable[[Tensor], Tensor]] = None) -> Tensor:
    """Bessel-corrected std of every score of the batch, on one process or over all of them.

    Args:
        scores: (B,) this process's scores.
        reduce_sum: tensor -> its elementwise sum over all processes; None for one process.

    Returns:
        Scalar (), the std of the concatenated scores of every process (TRL gathers them).
    """
    if reduce_sum is None:
        return scores.std()
    counted = torch.ones_like(scores, dtype=torch.bool).unsqueeze(1)  # (B, 1)
    _, var = global_masked_mean_var(scores.unsqueeze(1), counted, reduce_sum)
    return var.sqrt()


def group_normalized_advantages(
    scores: Tensor,
    group_size: int,
    scale_rewards: str = "group",
    eps: float = GRPO_EPS,
    reduce_sum: Optional[Callable[[Tensor], Tensor]] = None,
) -> Tensor:
    """GRPO's group-relative advantage (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300), and Dr. GRPO's.

    A_i = (r_i - mean_group(r)) / (std + eps), with std
        "group": the std of the prompt's G scores (GRPO; TRL's scale_rewards="group"),
        "batch": the std of all B scores, of every process with ``reduce_sum`` (TRL's scale_rewards="batch"),
        "none":  no division, A_i = r_i - mean_group(r) (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783; TRL's "none",
                 verl's norm_adv_by_std_in_grpo=False).
    std is Bessel-corrected (torch.std, as TRL and verl). eps defaults to ``GRPO_EPS``, TRL's 1e-4.
    A group whose scores are all equal gets exactly 0 (never NaN, also when the batch std is 0).

    Args:
        scores: (B,) sequence scores, B = P x G in the contiguous layout of the module docstring.
        group_size: G, completions per prompt, >= 2.
        scale_rewards: "group", "batch" or "none".
        eps: added to the std before dividing.
        reduce_sum: with several processes, a sum across them, for "batch"'s std (``batch_std``); groups
            are whole on each process, so "group" and "none" never need it. None for one process.

    Returns:
        (B,) advantages, same layout as ``scores``.

    Raises:
        ValueError: unknown ``scale_rewards``, or a bad ``group_size`` / shape (``grouped``).
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}; expected one of {', '.join(SCALE_REWARDS)}")
    groups = grouped(scores, group_size)  # (P, G)
    advantages = groups - groups.mean(dim=1, keepdim=True)  # (P, G)
    if scale_rewards == "group":
        advantages = advantages / (groups.std(dim=1, keepdim=True) + eps)
    elif scale_rewards == "batch":
        advantages = advantages / (batch_std(scores, reduce_sum) + eps)
    # Last, so that 0 / 0 (eps = 0) cannot leak a NaN out of a constant group.
    return torch.where(_constant_groups(groups), 0, advantages).reshape(-1)


def rloo_advantages(scores: Tensor, group_size: int) -> Tensor:
    """REINFORCE Leave-One-Out (Kool et al. 2019; Ahmadian et al. 2024, arXiv:2402.14740): the baseline
    of each completion is the mean score of the other G - 1 completions of its prompt.

    A_i = r_i - 1/(G-1) * sum_{j != i} r_j = G/(G-1) * (r_i - mean_group(r))

    RLOO puts the KL into the sequence reward: as TRL's RLOOTrainer (``rlhf_reward = scores -
    kl_coef * kl.sum(1)``), the caller passes ``scores - kl_coef * (kl * response_mask).sum(1)`` here.
    (OpenRLHF instead adds -kl_coef * kl_t per token after the baseline and sums returns; at gamma = 1
    its first-token return equals this advantage.)

    Args:
        scores: (B,) sequence rewards (KL already subtracted), contiguous groups of ``group_size``.
        group_size: G >= 2.

    Returns:
        (B,) advantages; exactly 0 for a group whose rewards are all equal.

    Raises:
        ValueError: ``group_size`` < 2 or a bad shape (``grouped``).
    """
    groups = grouped(scores, group_size)  # (P, G)
    leave_one_out = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)  # (P, G)
    return torch.where(_constant_groups(groups), 0, groups - leave_one_out).reshape(-1)


def group_reward_stats(scores: Tensor, group_size: int) -> GroupRewardStats:
    """Per-group std of the scores and the two metrics derived from it (see ``GroupRewardStats``).

    group_std_p = std(r_{p,1..G}) (Bessel-corrected);  reward_std = mean_p group_std_p;
    frac_reward_zero_std = mean_p [r_{p,1} = ... = r_{p,G}]

    Args:
        scores: (B,) contiguous groups of ``group_size``.
        group_size: G >= 2.

    Returns:
        GroupRewardStats(group_std (P,), reward_std (), frac_reward_zero_std ()), no grad.
    """
    with torch.no_grad():
        groups = grouped(scores, group_size)
        group_std = torch.where(_constant_groups(groups).squeeze(1), 0, groups.std(dim=1))  # (P,)
        zero_std = _constant_groups(groups).squeeze(1).to(group_std.dtype)
        return GroupRewardStats(group_std, group_std.mean(), zero_std.mean())


def informative_groups(scores: Tensor, group_size: int, scored: Optional[Tensor] = None) -> Tensor:
    """DAPO's dynamic sampling filter (Yu et al. 2025, arXiv:2503.14476, eq. 11; verl's ``algorithm.filter_groups``):
    the groups whose completions did not all score the same, the only ones grpo and rloo learn from.

    keep_p = [max_g r_{p,g} > min_g r_{p,g}]  and  every completion of group p scored

    Equality is exact (max == min, as ``_constant_groups``), not a std above a tolerance.

    Args:
        scores: (B,) the reward of each completion, contiguous groups of ``group_size``.
        group_size: G >= 2.
        scored: optional (B,) bool, False where the reward failed for a completion (its group teaches nothing).

    Returns:
        (P,) bool, True for a group to keep.
    """
    keep = ~_constant_groups(grouped(scores, group_size)).squeeze(1)
    if scored is not None:
        keep = keep & scored.view(-1, group_size).all(dim=1)
    return keep
