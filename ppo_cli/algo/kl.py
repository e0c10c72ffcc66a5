"""Per-token KL estimators between the policy and the frozen reference, and KL-coefficient controllers.

Shapes: B batch, T response length. Estimators follow J. Schulman, "Approximating KL Divergence"
(http://joschu.net/blog/kl-approx.html) and TRL's PPOTrainer (``kl_estimator`` "k1" / "k3").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the log-probs of the sampled tokens.

    k1 = logprobs - ref_logprobs                   (unbiased, can be negative; TRL's default)
    k2 = 0.5 * (logprobs - ref_logprobs)^2         (biased, >= 0, low variance)
    k3 = (exp(r) - 1) - r, r = ref_logprobs - logprobs   (unbiased, >= 0; TRL's "k3")

    Args:
        logprobs: (B, T) log pi(a_t | s_t) of the sampled tokens.
        ref_logprobs: (B, T) log pi_ref(a_t | s_t) of the same tokens.
        estimator: "k1", "k2" or "k3".

    In the loss (GRPO's KL term) pass ``ref_logprobs`` detached: k3 is then TRL's GRPO
    ``per_token_kl = exp(ref - logp) - (ref - logp) - 1``, with gradient 1 - exp(ref - logp) in logprobs.

    Returns:
        (B, T) per-token KL estimate. Not masked: the caller masks it (see ``shape_rewards``).

    Raises:
        ValueError: unknown ``estimator``.
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        # expm1 keeps precision near r = 0, where most tokens sit; exp(r) - 1 would cancel.
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}")


@dataclass
class FixedKLController:
    """A constant KL coefficient beta; ``update`` exists so the trainer treats both kinds alike.

    Attributes:
        value: beta, the weight of the per-token KL penalty in the shaped reward.
    """

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        """Leave ``value`` unchanged: a fixed coefficient ignores the measured KL."""

    def state_dict(self) -> dict:
        """Return {"value": beta} for a checkpoint."""
        return asdict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore from ``state_dict()``; unknown or missing keys raise TypeError."""
        self.value = FixedKLController(**state_dict).value


@dataclass
class AdaptiveKLController:
    """KL coefficient steered towards a target KL (Ziegler et al. 2019, "Fine-Tuning LMs from Human
    Preferences"; lm-human-preference-details ``train_policy_accelerate.py`` L293-302).

    error = clip(current_kl / target - 1, -0.2, 0.2)
    value <- value * (1 + error * n_steps / horizon)

    Attributes:
        value: beta, the current coefficient.
        target: the KL (nats per sequence, as the trainer measures it) to steer towards; > 0.
        horizon: steps over which a 20% error moves beta by 20%; > 0.
    """

    value: float
    target: float
    horizon: int

    def __post_init__(self) -> None:
        """Reject a target or horizon <= 0: update() divides by both."""
        if self.target <= 0 or self.horizon <= 0:
            raise ValueError(f"target and horizon must be > 0, got target={self.target}, horizon={self.horizon}")

    def update(self, current_kl: float, n_steps: int) -> None:
        """value <- value * (1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon).

        Args:
            current_kl: the KL measured on the last rollout (a float or a 0-d tensor).
            n_steps: samples (episodes) processed since the last update.
        """
        # The clip bounds the change per update, so one outlier batch cannot swing beta far.
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value = self.value * (1.0 + error * n_steps / self.horizon)

    def state_dict(self) -> dict:
        """Return {"value", "target", "horizon"} for a checkpoint."""
        return asdict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore every field from ``state_dict()``; unknown or missing keys raise TypeError."""
        restored = AdaptiveKLController(**state_dict)
        self.value, self.target, self.horizon = restored.value, restored.target, restored.horizon
