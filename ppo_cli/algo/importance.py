"""Off-policy correction for a rollout sampled by another engine than the one that trains.

When a separate inference engine (vLLM) samples the rollout, its token probabilities differ from
the trained policy's own forward by numerics (other kernels, bf16 accumulation, another attention
implementation), so the rollout is slightly off-policy. Truncated importance sampling (Yao et al.
2025, "Your efficient RL framework secretly brings you off-policy RL training") reweights each
token's policy-gradient term by pi_trainer / pi_sampler, capped so that a rare token the sampler
found unlikely cannot dominate the batch.

Shapes: B batch, T response length. Masks are bool and True means "counts".
"""

from __future__ import annotations

import torch
from torch import Tensor


def truncated_is_weights(old_logprobs: Tensor, sampler_logprobs: Tensor, response_mask: Tensor, clip: float) -> Tensor:
    """Per-token truncated importance weights, detached.

    w_t = min(exp(old_logprobs_t - sampler_logprobs_t), clip) on counted tokens, 1 elsewhere.

    Args:
        old_logprobs: (B, T) log pi_old(a_t | s_t) from the trainer's own forward at rollout time.
        sampler_logprobs: (B, T) log-probs the sampler drew the same tokens with.
        response_mask: bool, (B, T).
        clip: the cap C > 0 (only the upper side is truncated: weights below 1 stay as they are).

    Returns:
        (B, T) weights, no grad.
    """
    # where() first: padding may hold anything (0, -inf), and exp of its difference must not overflow.
    log_ratio = torch.where(response_mask, old_logprobs.detach() - sampler_logprobs.detach(), 0.0)
    return torch.exp(log_ratio).clamp(max=clip)
