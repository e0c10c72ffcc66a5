"""Masked reductions: every statistic is taken over the entries a bool mask marks True.

Shapes: B batch, T response length. Masks are bool and True means "counts" (the trained tokens: the
action mask, which may have holes where an environment's tokens sit between the policy's; a
``value_mask``): every statistic counts the True entries only, wherever they are. Semantics follow TRL's ``trl.trainer.utils`` (``masked_mean``, ``masked_var``,
``masked_whiten``), except that the flag keeping the mean is ``keep_mean`` (TRL's
``shift_mean=False``).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

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


def global_masked_mean_var(values: Tensor, mask: Tensor, reduce_sum: Callable[[Tensor], Tensor]) -> tuple[Tensor, Tensor]:
    """Masked mean and unbiased variance over the union of every process's entries.

    mean = sum_p S_p / sum_p n_p,   var = sum_p sum_i (x_i - mean)^2 [mask_i] / (n - 1)

    Two passes, as ``masked_var``: ``reduce_sum`` (a sum across processes, e.g. an all-reduce) is
    called on the local sums, so every process gets the statistics of the concatenated batch.

    Args:
        values: (B, T) this process's entries.
        mask: bool, (B, T).
        reduce_sum: tensor -> the elementwise sum of that tensor over all processes.

    Returns:
        (mean, var), scalars (), identical on every process.
    """
    totals = reduce_sum(torch.stack([masked_sum(values, mask), mask.sum().to(values.dtype)]))
    count = totals[1]
    mean = totals[0] / count.clamp(min=1)
    squares = reduce_sum(masked_sum((values - mean) ** 2, mask))
    return mean, squares / (count - 1).clamp(min=1)


def masked_whiten(
    values: Tensor,
    mask: Tensor,
    keep_mean: bool = False,
    eps: float = 1e-8,
    reduce_sum: Optional[Callable[[Tensor], Tensor]] = None,
) -> Tensor:
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
        reduce_sum: with several processes, a sum across them: the statistics are then those of
            the whole distributed batch (``global_masked_mean_var``). None for one process.

    Returns:
        (B, T); entries outside the mask are 0.

    Raises:
        ValueError: no entry counts (from ``masked_var``).
    """
    if reduce_sum is None:
        mean, var = masked_mean(values, mask), masked_var(values, mask)
    else:
        mean, var = global_masked_mean_var(values, mask, reduce_sum)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if keep_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, 0)


def mask_truncated_completions(response_mask: Tensor, finished: Tensor) -> Tensor:
    """Drop the rows that did not finish from the loss (DAPO's overlong filtering, Yu et al. 2025,
    arXiv:2503.14476; TRL's GRPOConfig ``mask_truncated_completions``).

    mask_bt = response_mask_bt and finished_b

    A row cut at max_new_tokens never sampled its stop token, so its score judges an unfinished
    answer; dropping it keeps that noise out of the gradient.

    Args:
        response_mask: bool, (B, T).
        finished: bool, (B,); True where the stop token was sampled (``Generation.finished``).

    Returns:
        bool (B, T); rows with finished False are all False.
    """
    return response_mask & finished.unsqueeze(1)
