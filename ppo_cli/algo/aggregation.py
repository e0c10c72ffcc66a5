"""Reductions of a (B, T) per-token loss to the scalar that is back-propagated.

Shapes: B batch, T response length; ``response_mask`` is bool, True on real response tokens. The
three modes are verl's ``agg_loss`` (verl/trainer/ppo/core_algos.py) "token-mean",
"seq-mean-token-mean" and "seq-mean-token-sum-norm", spelt with underscores. They differ in how a
long response weighs against a short one:

- token_mean: every real token of the batch weighs the same (PPO, DAPO; TRL's "dapo"/"bnpo").
- seq_mean_token_mean: every sequence weighs the same, its tokens share it (GRPO paper; TRL's "grpo"),
  so a token of a long response counts less: the length bias Dr. GRPO points out.
- seq_mean_token_sum_norm: every token weighs 1 / max_response_length, a constant (Dr. GRPO; TRL's
  "dr_grpo", which divides by ``max_completion_length``).
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from .masking import masked_mean, masked_sum

LOSS_AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def token_mean(per_token_loss: Tensor, response_mask: Tensor) -> Tensor:
    """loss = sum_{b,t} m_bt * l_bt / sum_{b,t} m_bt   (0 when no token counts).

    Args:
        per_token_loss: (B, T).
        response_mask: bool, (B, T).

    Returns:
        Scalar ().
    """
    return masked_mean(per_token_loss, response_mask)


def seq_mean_token_mean(per_token_loss: Tensor, response_mask: Tensor) -> Tensor:
    """loss = 1/B sum_b ( sum_t m_bt * l_bt / sum_t m_bt ).

    A row with no real token contributes 0 and still counts in the 1/B (TRL's "grpo" clamps the
    token count to 1 the same way; verl's would divide 0 by 0).

    Args:
        per_token_loss: (B, T).
        response_mask: bool, (B, T).

    Returns:
        Scalar ().
    """
    return masked_mean(per_token_loss, response_mask, dim=1).mean()


def seq_mean_token_sum_norm(per_token_loss: Tensor, response_mask: Tensor, max_response_length: int) -> Tensor:
    """loss = 1/B sum_b ( sum_t m_bt * l_bt / max_response_length ).

    The mean over sequences follows the Dr. GRPO paper and TRL's "dr_grpo" (sum / (B *
    max_completion_length)); verl's "seq-mean-token-sum-norm" divides the sum over all sequences by
    ``max_response_length`` without the 1/B, a constant factor B for a fixed batch size.

    Args:
        per_token_loss: (B, T).
        response_mask: bool, (B, T).
        max_response_length: the constant normaliser, the generation's max_new_tokens. It must not be
            T: a micro-batch trimmed to its longest response would make it vary, bringing back the
            length bias that this mode removes.

    Returns:
        Scalar ().
    """
    return (masked_sum(per_token_loss, response_mask, dim=1) / max_response_length).mean()


def aggregate_loss(
    per_token_loss: Tensor, response_mask: Tensor, mode: str = "token_mean", max_response_length: Optional[int] = None
) -> Tensor:
    """Reduce a per-token loss by ``mode``, one of LOSS_AGG_MODES (see the module docstring).

    Args:
        per_token_loss: (B, T).
        response_mask: bool, (B, T).
        mode: "token_mean", "seq_mean_token_mean" or "seq_mean_token_sum_norm".
        max_response_length: needed by "seq_mean_token_sum_norm" only.

    Returns:
        Scalar (), with grad when ``per_token_loss`` has it.

    Raises:
        ValueError: unknown ``mode``, or "seq_mean_token_sum_norm" without a positive ``max_response_length``.
    """
    if mode == "token_mean":
        return token_mean(per_token_loss, response_mask)
    if mode == "seq_mean_token_mean":
        return seq_mean_token_mean(per_token_loss, response_mask)
    if mode == "seq_mean_token_sum_norm":
        if max_response_length is None or max_response_length <= 0:
            raise ValueError(
                f"seq_mean_token_sum_norm needs max_response_length > 0 (the generation's max_new_tokens), "
                f"got {max_response_length}"
            )
        return seq_mean_token_sum_norm(per_token_loss, response_mask, max_response_length)
    raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {', '.join(LOSS_AGG_MODES)}")
