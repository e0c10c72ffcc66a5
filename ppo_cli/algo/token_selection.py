"""Which tokens the policy loss trains on: the high-entropy "forking" tokens (Wang et al. 2025, "Beyond the
80/20 Rule", arXiv:2506.01939; TRL's GRPOConfig.top_entropy_quantile and GRPOTrainer.get_high_entropy_mask).

Shapes: B episodes, T response length. Masks are bool and True means "counts".
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class EntropySelection(NamedTuple):
    """Result of ``high_entropy_mask``.

    keep: bool (B, T), the tokens whose entropy is at least ``threshold``, within the mask.
    threshold: scalar (), the (1 - top_quantile) quantile of the masked entropies (0 for an empty mask).
    """

    keep: Tensor
    threshold: Tensor


@torch.no_grad()
def high_entropy_mask(entropy: Tensor, mask: Tensor, top_quantile: float, all_entropy: Tensor | None = None,
                      all_mask: Tensor | None = None) -> EntropySelection:
    """The tokens in the top ``top_quantile`` fraction of entropy among the masked tokens, as TRL selects them.

    threshold = quantile(all_entropy[all_mask], 1 - top_quantile)   (torch.quantile: linear interpolation)
    keep      = (entropy >= threshold) & mask

    ``all_entropy``/``all_mask`` are the micro-batch's tokens on every process (TRL gathers them before
    taking the quantile); without them, ``entropy``/``mask``.

    Ties at the threshold are kept, so ``keep`` may hold a few more than top_quantile of the tokens; an
    empty mask keeps nothing. No gradient flows through the selection (TRL computes the entropies under
    no_grad). The caller multiplies the per-token policy loss by ``keep`` and leaves the loss's
    normaliser (the token count of the mask) as it was, as TRL does.

    Args:
        entropy: (B, T) per-token entropy of the policy, nats (>= 0).
        mask: bool (B, T), the tokens the loss counts.
        top_quantile: in (0, 1]; 1 keeps every masked token.
        all_entropy: optional (B', T'') the entropies the threshold is taken over (every process's micro-batch).
        all_mask: bool (B', T''), with ``all_entropy``.

    Returns:
        EntropySelection(keep (B, T) bool, threshold ()).
    """
    # At least float32 (torch.quantile refuses half precision); compared in the same dtype, so the lowest
    # entropy is never rounded past itself.
    dtype = torch.promote_types(entropy.dtype, torch.float32)
    entropy = entropy.detach().to(dtype)
    values = entropy[mask] if all_entropy is None else all_entropy.detach().to(dtype)[all_mask]
    if values.numel() == 0:
        return EntropySelection(torch.zeros_like(mask), torch.zeros((), device=entropy.device))
    threshold = torch.quantile(values, 1.0 - top_quantile)
    return EntropySelection((entropy >= threshold) & mask, threshold)
