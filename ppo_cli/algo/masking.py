"""Masked reductions: every statistic is taken over the entries a bool mask marks True.

Shapes: B batch, T response length. Masks are bool and True means "counts" (``response_mask``,
``value_mask``). Semantics follow TRL's ``trl.trainer.utils`` (``masked_mean``, ``masked_var``,
``masked_whiten``), except that the flag keeping the mean is ``keep_mean`` (TRL's
``shift_mean=False``).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import Tensor

Dim = Optional[Union[int, Sequence[int]]]


def masked_sum(values: Tensor, mask: Tensor, dim: Dim = None) -> Tensor:
    """Sum of ``values`` over the entries where ``mask`` is True.

    masked_sum = sum_i values_i * [mask_i]

    Args:
        values: (B, T), or any shape that ``mask`` broadcasts with.
        mask: bool, (B, T); True means the entry counts.
        dim: dimension(s) to reduce; None reduces everything to a scalar.

    Returns:
        ``values``' shape with ``dim`` removed; a scalar () when ``dim`` is None.
    """
    # where(), not values * mask: 0 * inf = NaN, so padding holding inf or NaN would leak in.
    kept = torch.where(mask, values, 0)
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: Dim = None) -> Tensor:
    """Mean of ``values`` over the entries where ``mask`` is True.

    masked_mean = sum_i values_i * [mask_i] / max(1, sum_i [mask_i])

    Args:
        values: (B, T), or any shape that ``mask`` broadcasts with.
        mask: bool, (B, T); True means the entry counts.
        dim: dimension(s) to reduce; None reduces everything to a scalar.

    Returns:
        ``values``' shape with ``dim`` removed; a scalar () when ``dim`` is None. Where no entry
        counts the mean is 0, not NaN.
    """
    values, mask = torch.broadcast_tensors(values, mask)
    count = mask.sum() if dim is None else mask.sum(dim)
    # An empty row (a response cut to zero tokens) must give 0, not 0 / 0 = NaN.
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``values`` over the entries where ``mask`` is True (TRL semantics).

    var = masked_mean((values - masked_mean(values))^2)
    unbiased: var * n / (n - 1), n = number of True entries (Bessel's correction)

    Args:
        values: (B, T), or any shape that ``mask`` broadcasts with.
        mask: bool, (B, T); True means the entry counts.
        unbiased: apply Bessel's correction.

    Returns:
        Scalar (). A single counted entry has variance 0.

    Raises:
        ValueError: ``unbiased`` and no entry counts (TRL raises here too: it happens when a
            mini-batch holds only empty responses).
    """
    values, mask = torch.broadcast_tensors(values, mask)
    variance = masked_mean((values - masked_mean(values, mask)) ** 2, mask)
    if not unbiased:
        return variance
    count = mask.sum()
    # bool(count == 0) syncs with the GPU; this runs once per rollout, not once per token.
    if count == 0:
        raise ValueError("masked_var(unbiased=True) needs at least one True entry in mask, got none")
    # n / max(1, n - 1): one entry has variance 0, and 0 * (1 / 0) would be NaN.
    return variance * count / (count - 1).clamp(min=1)


def masked_whiten(values: Tensor, mask: Tensor, keep_mean: bool = False, eps: float = 1e-8) -> Tensor:
    """Standardise ``values`` over the masked entries: zero mean, unit variance.

    whitened = (values - mean) * rsqrt(var + eps)            (keep_mean=False, the default)
    whitened = (values - mean) * rsqrt(var + eps) + mean     (keep_mean=True)
    with mean = masked_mean(values, mask), var = masked_var(values, mask, unbiased=True).

    keep_mean=False is TRL's and OpenAI's ``whiten(shift_mean=True)``: advantages come out
    zero-mean. (torchtune's ``shift_mean=True`` does the opposite; do not copy it.)

    Args:
        values: (B, T).
        mask: bool, (B, T); True means the entry counts.
        keep_mean: add the mean back, so only the scale is normalised (TRL's reward whitening).
        eps: added to the variance so constant inputs do not divide by zero.

    Returns:
        (B, T); entries outside the mask are 0.

    Raises:
        ValueError: no entry counts (from ``masked_var``).
    """
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + eps)
    if keep_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, 0)
