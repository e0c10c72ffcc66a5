"""Reward shaping by response length: DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476,
eq. 13; verl's ``reward_model.overlong_buffer``, TRL's ``get_soft_overlong_punishment``).

Plain numbers, no torch: the reward stack adds it to each episode's score.
"""

from __future__ import annotations


def soft_overlong_penalty(length: int, max_length: int, buffer: int, penalty: float) -> float:
    """The (non-positive) reward added to a response of ``length`` policy tokens.

    expected = max_length - buffer
    r = 0                                             length <= expected
    r = -penalty * (length - expected) / buffer       expected < length <= max_length
    r = -penalty                                      length > max_length

    Linear from 0 at ``expected`` down to -penalty at ``max_length`` (verl's
    ``min(-(length - expected) / buffer * penalty, 0)``; TRL's with penalty 1, which also caps past the limit).

    Args:
        length: the response's sampled (policy) tokens; an environment's tokens inside an episode do not count.
        max_length: generation.max_new_tokens.
        buffer: tokens before ``max_length`` over which the penalty grows; 0 turns it off (returns 0.0).
        penalty: the penalty at ``max_length``.
    """
    if buffer <= 0:
        return 0.0
    exceed = length - (max_length - buffer)
    if exceed <= 0:
        return 0.0
    return -penalty * min(exceed / buffer, 1.0)
