"""PPO losses and the diagnostics logged with them.

Shapes: B batch, T response length, V vocab. Masks are bool and True means "counts". Formulas
and statistics follow TRL's PPOTrainer (``pg_losses``/``pg_losses2``, ``vf_losses1``/``vf_losses2``,
``pg_clipfrac``, ``approxkl``) and cleanrl's ``ppo.py`` (explained variance). The asymmetric clip
(DAPO's clip-higher) and the sequence-level ratio (GSPO) follow verl's ``compute_policy_loss_vanilla``
and ``compute_policy_loss_gspo`` (verl/trainer/ppo/core_algos.py); the clip fractions by direction
follow TRL's GRPOTrainer (``clip_ratio/low_mean``, ``clip_ratio/high_mean``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .aggregation import aggregate_loss
from .masking import masked_mean, masked_var

RATIO_LEVELS = ("token", "sequence")


class PolicyLossOutput(NamedTuple):
    """Result of ``clipped_policy_loss``; every field is a scalar ().

    loss: the clipped surrogate loss, with grad.
    clipfrac: fraction of counted tokens where the clipped branch won; no grad. This is verl's
        ``pg_clipfrac`` and equals clipfrac_low + clipfrac_high (TRL's ``clip_ratio/region_mean``).
    approx_kl: 0.5 * mean((logprobs - old_logprobs)^2), policy drift this step; no grad.
    ratio_mean: mean of the ratio the surrogate used over counted tokens; no grad.
    clipfrac_low: fraction of counted tokens with ratio < 1 - cliprange_low and A < 0 (TRL's
        ``clip_ratio/low_mean``); no grad. Not verl's ``pg_clipfrac_lower``, which counts the
        dual-clip bound ratio > clip_ratio_c (3) on A < 0, a clip this loss does not have.
    clipfrac_high: fraction of counted tokens with ratio > 1 + cliprange_high and A > 0 (TRL's
        ``clip_ratio/high_mean``); no grad.
    """

    loss: Tensor
    clipfrac: Tensor
    approx_kl: Tensor
    ratio_mean: Tensor
    clipfrac_low: Tensor
    clipfrac_high: Tensor


class ClippedSurrogate(NamedTuple):
    """Result of ``clipped_surrogate``, per token, (B, T) each.

    per_token: max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high)), with grad.
    clipped_low: bool, ratio < 1 - eps_low and A < 0 (the clipped branch wins on the low side).
    clipped_high: bool, ratio > 1 + eps_high and A > 0 (the clipped branch wins on the high side).
    """

    per_token: Tensor
    clipped_low: Tensor
    clipped_high: Tensor


class ValueLossOutput(NamedTuple):
    """Result of ``clipped_value_loss``; every field is a scalar ().

    loss: the clipped value loss, with grad.
    clipfrac: fraction of counted tokens where the clipped squared error was larger; no grad.
    """

    loss: Tensor
    clipfrac: Tensor


def clipped_surrogate(
    ratio: Tensor, advantages: Tensor, cliprange_low: float, cliprange_high: float
) -> ClippedSurrogate:
    """PPO's clipped surrogate per token, with separate clip radii below and above 1 (DAPO's clip-higher,
    Yu et al. 2025, arXiv:2503.14476: a larger eps_high lets unlikely tokens with A > 0 grow).

    per_token = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))

    The clipped branch wins exactly when A > 0 and ratio > 1 + eps_high (``clipped_high``) or A < 0
    and ratio < 1 - eps_low (``clipped_low``); the two never overlap.

    Args:
        ratio: (B, T) pi / pi_old (token-level, or GSPO's sequence ratio broadcast to tokens).
        advantages: (B, T), constant.
        cliprange_low: eps_low.
        cliprange_high: eps_high.

    Returns:
        ClippedSurrogate(per_token, clipped_low, clipped_high), (B, T) each; not masked.
    """
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cliprange_low, 1.0 + cliprange_high)
    clipped_low = (ratio < 1.0 - cliprange_low) & (advantages < 0)
    clipped_high = (ratio > 1.0 + cliprange_high) & (advantages > 0)
    return ClippedSurrogate(torch.maximum(unclipped, clipped), clipped_low, clipped_high)


def sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, response_mask: Tensor) -> Tensor:
    """GSPO's length-normalised sequence ratio, broadcast to tokens as in GSPO-token (Zheng et al. 2025,
    "Group Sequence Policy Optimization", arXiv:2507.18071; verl's ``compute_policy_loss_gspo``).

    log s_i   = 1/|y_i| * sum_t (logprobs_t - old_logprobs_t)        over the real tokens of row i
    log s_i,t = sg[log s_i] + logprobs_t - sg[logprobs_t]            (sg = stop-gradient)

    The value of log s_i,t is log s_i on every token of the row; its gradient in logprobs_t is 1, so
    with sequence advantages and ``seq_mean_token_mean`` the update is GSPO's sequence-level one.

    Args:
        logprobs: (B, T) log pi(a_t | s_t), with grad.
        old_logprobs: (B, T) from the rollout; constant.
        response_mask: bool, (B, T).

    Returns:
        (B, T) log-ratios, 0 outside the mask (an empty row is 0 everywhere).
    """
    # Zero the padding first: inf or NaN there would otherwise reach the gradient as 0 * inf.
    logprobs = torch.where(response_mask, logprobs, 0)
    token_log_ratio = torch.where(response_mask, logprobs - old_logprobs.detach(), 0)  # (B, T)
    log_s = masked_mean(token_log_ratio, response_mask, dim=1).detach().unsqueeze(1)  # (B, 1)
    return torch.where(response_mask, log_s + logprobs - logprobs.detach(), 0)


def clipped_policy_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, cliprange: float,
    token_weights: Tensor | None = None, cliprange_high: Optional[float] = None, ratio_level: str = "token",
    loss_agg_mode: str = "token_mean", max_response_length: Optional[int] = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate loss (Schulman et al. 2017, eq. 7), negated for minimisation.

    ratio_t = exp(logprobs_t - old_logprobs_t)            (ratio_level "token")
    ratio_t = s_i,t of ``sequence_log_ratio``             (ratio_level "sequence", GSPO)
    loss    = aggregate(max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - eps, 1 + eps_high)))
    clipfrac = masked_mean([clipped branch > unclipped branch]);  approx_kl = 0.5 * masked_mean(log_ratio^2)

    Args:
        logprobs: (B, T) log pi(a_t | s_t) under the current policy, with grad.
        old_logprobs: (B, T) log pi_old(a_t | s_t) from the rollout; treated as a constant.
        advantages: (B, T) usually whitened; treated as a constant.
        response_mask: bool, (B, T).
        cliprange: eps, the clip radius of the ratio (eps_low below 1).
        token_weights: optional (B, T) constant factors on each token's clipped term (importance
            weights of a rollout drawn by another sampler: ``importance.truncated_is_weights``).
        cliprange_high: eps_high above 1 (DAPO's clip-higher); None means ``cliprange``.
        ratio_level: "token" (PPO, GRPO) or "sequence" (GSPO; pair it with "seq_mean_token_mean",
            which verl's GSPO loss always uses).
        loss_agg_mode: ``aggregation.aggregate_loss`` mode; "token_mean" (PPO's masked mean) by default.
        max_response_length: the constant of "seq_mean_token_sum_norm".

    Returns:
        PolicyLossOutput(loss, clipfrac, approx_kl, ratio_mean, clipfrac_low, clipfrac_high), scalars ().

    Raises:
        ValueError: unknown ``ratio_level`` or ``loss_agg_mode``.
    """
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"unknown ratio_level {ratio_level!r}; expected one of {', '.join(RATIO_LEVELS)}")
    # masked_mean's where() keeps off-mask padding (INVALID_LOGPROB, inf, NaN) out of the forward,
    # but backward would still form 0 * inf = NaN; zeroing here, on the gradient's only path, stops it.
    log_ratio = torch.where(response_mask, logprobs - old_logprobs.detach(), 0)  # (B, T)
    used_log_ratio = log_ratio if ratio_level == "token" else sequence_log_ratio(logprobs, old_logprobs, response_mask)
    ratio = torch.exp(used_log_ratio)  # (B, T)
    high = cliprange if cliprange_high is None else cliprange_high
    surrogate = clipped_surrogate(ratio, advantages.detach(), cliprange, high)
    per_token = surrogate.per_token
    if token_weights is not None:
        per_token = per_token * token_weights.detach()
    loss = aggregate_loss(per_token, response_mask, loss_agg_mode, max_response_length)
    with torch.no_grad():
        low_frac = masked_mean(surrogate.clipped_low.to(ratio.dtype), response_mask)
        high_frac = masked_mean(surrogate.clipped_high.to(ratio.dtype), response_mask)
        approx_kl = 0.5 * masked_mean(log_ratio**2, response_mask)
        ratio_mean = masked_mean(ratio, response_mask)
    return PolicyLossOutput(loss, low_frac + high_frac, approx_kl, ratio_mean, low_frac, high_frac)


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
