"""Model FLOPs utilisation (MFU) and decode bandwidth of a PPO update, from counts: pure arithmetic.

As verl's ``perf/mfu``: a forward over one token costs 2 x params FLOPs, a backward twice that (the
matmul rule; attention's own FLOPs are left out, as the usual estimate does). MFU divides the FLOPs a
phase needs by its seconds and by the machine's measured matmul peak in the run's precision (the CPU
probe's update-shaped Linear, engine/precision_probe.py). Decoding is memory-bound: each step reads
every policy weight once for the whole batch, so its useful figure is bytes per second.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSizes:
    """Parameter counts of what an update runs (0 where a phase does not run)."""

    policy: int  # the policy's parameters (LoRA: base + adapter); generation and the update's forward
    rollout_forwards: int  # summed parameters of the rollout's full-sequence forwards: old log-probs (unless
    #                        taken from generation), reference, a separate critic, reward models
    trained_forwards: int  # summed parameters of the models the update runs forward and backward
    policy_bytes: int  # bytes of the policy's weights: what a decode step reads


def rollout_flops(sizes: ModelSizes, prompt_tokens: int, generated_tokens: int, sequence_tokens: int) -> float:
    """2 x policy x (prompt + generated tokens) for generation (prefill, then one token per step),
    plus 2 x rollout_forwards x sequence_tokens for the scoring forwards (B x (P + T) positions)."""
    return 2.0 * sizes.policy * (prompt_tokens + generated_tokens) + 2.0 * sizes.rollout_forwards * sequence_tokens


def update_flops(sizes: ModelSizes, sequence_tokens: int, ppo_epochs: int) -> float:
    """ppo_epochs x (2 forward + 4 backward) x trained_forwards x sequence_tokens."""
    return 6.0 * sizes.trained_forwards * sequence_tokens * ppo_epochs


def mfu(flops: float, seconds: float, peak_flops: float) -> float:
    """Achieved FLOP/s over the peak: 1.0 would be every second spent in matmuls at the peak rate."""
    return flops / seconds / peak_flops


def decode_gbps(policy_bytes: int, decode_steps: int, seconds: float) -> float:
    """GB/s of weights read while generating: policy_bytes per decode step (the batch shares each read)."""
    return policy_bytes * decode_steps / seconds / 1e9
