"""PPO losses and the diagnostics logged with them.

Shapes: B batch, T response length, V vocab. Masks are bool and True means "counts". Formulas
and statistics follow TRL's PPOTrainer (``pg_losses``/``pg_losses2``, ``vf_losses1``/``vf_losses2``,
``pg_clipfrac``, ``approxkl``) and cleanrl's ``ppo.py`` (explained variance).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .masking import masked_mean, masked_var


class PolicyLossOutput(NamedTuple):
    """Result of ``clipped_policy_loss``; every field is a scalar ().

    loss: the clipped surrogate loss, with grad.
    clipfrac: fraction of counted tokens where the clipped branch won; no grad.
    approx_kl: 0.5 * mean((logprobs - old_logprobs)^2), policy drift this step; no grad.
    ratio_mean: mean of pi / pi_old over counted tokens; no grad.
    """

    loss: Tensor
    clipfrac: Tensor
    approx_kl: Tensor
    ratio_mean: Tensor


class ValueLossOutput(NamedTuple):
    """Result of ``clipped_value_loss``; every field is a scalar ().

    loss: the clipped value loss, with grad.
    clipfrac: fraction of counted tokens where the clipped squared error was larger; no grad.
    """

    loss: Tensor
    clipfrac: Tensor


def clipped_policy_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, cliprange: float,
    token_weights: Tensor | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate loss (Schulman et al. 2017, eq. 7), negated for minimisation.

    ratio_t = exp(logprobs_t - old_logprobs_t)
    loss    = masked_mean(max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - eps, 1 + eps)))
    clipfrac = masked_mean([clipped branch > unclipped branch]);  approx_kl = 0.5 * masked_mean(log_ratio^2)

    Args:
        logprobs: (B, T) log pi(a_t | s_t) under the current policy, with grad.
        old_logprobs: (B, T) log pi_old(a_t | s_t) from the rollout; treated as a constant.
        advantages: (B, T) usually whitened; treated as a constant.
        response_mask: bool, (B, T).
        cliprange: eps, the clip radius of the ratio.
        token_weights: optional (B, T) constant factors on each token's clipped term (importance
            weights of a rollout drawn by another sampler: ``importance.truncated_is_weights``).

    Returns:
        PolicyLossOutput(loss, clipfrac, approx_kl, ratio_mean), each a scalar ().
    """
    # masked_mean's where() keeps off-mask padding (INVALID_LOGPROB, inf, NaN) out of the forward,
    # but backward would still form 0 * inf = NaN; zeroing here, on the gradient's only path, stops it.
    log_ratio = torch.where(response_mask, logprobs - old_logprobs.detach(), 0)  # (B, T)
    advantages = advantages.detach()
    ratio = torch.exp(log_ratio)  # (B, T)
    pg_losses = -advantages * ratio
    pg_losses_clipped = -advantages * ratio.clamp(1.0 - cliprange, 1.0 + cliprange)
    per_token = torch.maximum(pg_losses, pg_losses_clipped)
    if token_weights is not None:
        per_token = per_token * token_weights.detach()
    loss = masked_mean(per_token, response_mask)
    with torch.no_grad():
        clipfrac = masked_mean((pg_losses_clipped > pg_losses).to(ratio.dtype), response_mask)
        approx_kl = 0.5 * masked_mean(log_ratio**2, response_mask)
        ratio_mean = masked_mean(ratio, response_mask)
    return PolicyLossOutput(loss, clipfrac, approx_kl, ratio_mean)


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, value_mask: Tensor, cliprange_value: float
) -> ValueLossOutput:
    """Clipped value loss: the critic may not move more than ``cliprange_value`` from its rollout value.

    values_clipped = old_values + clip(values - old_values, -c, c)
    loss = 0.5 * masked_mean(max((values - returns)^2, (values_clipped - returns)^2))
    clipfrac = masked_mean([(values_clipped - returns)^2 > (values - returns)^2])

    Args:
        values: (B, T) current critic values, with grad.
        old_values: (B, T) critic values from the rollout.
        returns: (B, T) GAE returns, the regression target.
        value_mask: bool, (B, T).
        cliprange_value: c, the clip radius of the value update.

    Returns:
        ValueLossOutput(loss, clipfrac), each a scalar ().
    """
    # As in clipped_policy_loss: off-mask garbage must not reach the gradient as 0 * inf.
    values = torch.where(value_mask, values, 0)
    values_clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    squared_errors = (values - returns) ** 2  # (B, T)
    squared_errors_clipped = (values_clipped - returns) ** 2  # (B, T)
    loss = 0.5 * masked_mean(torch.maximum(squared_errors, squared_errors_clipped), value_mask)
    with torch.no_grad():
        clipped = squared_errors_clipped > squared_errors
        clipfrac = masked_mean(clipped.to(squared_errors.dtype), value_mask)
    return ValueLossOutput(loss, clipfrac)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution softmax(logits) at each position.

    H = -sum_v p_v log p_v = logsumexp(logits) - sum_v softmax(logits)_v * logits_v

    This form (TRL's) never takes log of a probability, so p_v = 0 cannot give 0 * -inf. Logits
    must be finite: a -inf logit makes softmax * logits NaN (pass a large negative number instead).

    Args:
        logits: (B, T, V), already divided by the sampling temperature.

    Returns:
        (B, T) entropy in nats; differentiable (for an entropy bonus).
    """
    probs = torch.softmax(logits, dim=-1)  # (B, T, V)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """Fraction of the variance of the returns that the critic's values explain (cleanrl's metric).

    ev = 1 - var(returns - values) / var(returns), variances over the masked entries

    1 is a perfect critic, 0 is no better than a constant, negative is worse than a constant.
    When var(returns) == 0 (constant returns, or no counted entry) the ratio is undefined; this
    returns 0 rather than cleanrl's NaN, so metrics.jsonl stays numeric.

    Args:
        values: (B, T) critic values.
        returns: (B, T) GAE returns.
        mask: bool, (B, T).

    Returns:
        Scalar (), without grad.
    """
    with torch.no_grad():
        # Biased variances: the Bessel factors cancel in the ratio, and an empty mask must not raise.
        var_returns = masked_var(returns, mask, unbiased=False)
        var_residual = masked_var(returns - values, mask, unbiased=False)
        has_variance = var_returns > 0
        ratio = var_residual / torch.where(has_variance, var_returns, 1)
        return torch.where(has_variance, 1 - ratio, 0)
