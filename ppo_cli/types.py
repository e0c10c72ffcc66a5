"""Typed containers passed between the engine and the trainer.

Shapes: B episodes in the batch, P prompt length (left-padded), T response length (right-padded): the
response is every token after the prompt, the policy's and (in an episode with several turns) the
environment's. Masks are bool and True means "counts".

Two masks over the response, because attending and training differ: ``response_mask`` marks every real
token the model attends to (it builds the attention mask); ``action_mask`` marks the policy's sampled
tokens only, the ones trained on (losses, KL, entropy, whitening, advantages). A tool's answer inside an
episode is in the first and never in the second. With one turn they are equal.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Generation(NamedTuple):
    """Sampled responses, truncated after the first stop token."""

    prompt_ids: torch.Tensor  # (B, P) left-padded
    prompt_mask: torch.Tensor  # (B, P) True on real prompt tokens
    response_ids: torch.Tensor  # (B, T) pad after the stop token
    response_mask: torch.Tensor  # (B, T) True on real tokens up to and including the stop token: attended
    finished: torch.Tensor  # (B,) True when the stop token was sampled
    action_mask: torch.Tensor  # (B, T) True on the policy's sampled tokens: trained; within response_mask

    @property
    def sequences(self) -> torch.Tensor:  # (B, P + T)
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:  # (B, P + T)
        return torch.cat([self.prompt_mask, self.response_mask], dim=1)

    @property
    def response_lengths(self) -> torch.Tensor:  # (B,)
        return self.response_mask.sum(dim=1)


class Rollout(NamedTuple):
    """One PPO batch: what the policy did and what it was worth, all frozen (no grad)."""

    generation: Generation
    prompts: list  # (B,) as read: a string, or a conversation (list of {role, content} messages)
    responses: list[str]
    logprobs: torch.Tensor  # (B, T) log pi_old(token), temperature-scaled, 0 outside response_mask
    ref_logprobs: torch.Tensor  # (B, T) log pi_ref(token), same scaling
    values: torch.Tensor  # (B, T) V_old(state before each response token), 0 outside action_mask; NoCritic: all 0
    scores: torch.Tensor  # (B,) total sequence reward: weighted components + penalties; 0 where not scored
    score_components: dict[str, list]  # component name -> per-episode value (penalties included); None: failed
    fixed_value_features: torch.Tensor | None = None  # (B, T, H) a frozen value model's, reused by the update
    sampler_logprobs: torch.Tensor | None = None  # (B, T) a separate sampler's (vLLM) log-probs of the tokens, 0 outside
    scored: torch.Tensor | None = None  # (B,) bool, True where every reward component scored the episode (None: all)
    reward_failures: dict[str, str] | None = None  # component name -> its latest failure this rollout, one line

    @property
    def train_mask(self) -> torch.Tensor:  # (B, T)
        """action_mask less the episodes without a reward: what the losses and whitening count."""
        mask = self.generation.action_mask
        return mask if self.scored is None else mask & self.scored.unsqueeze(1)


class Advantages(NamedTuple):
    rewards: torch.Tensor  # (B, T) shaped: -beta*KL per token + score on the last real token
    non_score_rewards: torch.Tensor  # (B, T) the -beta*KL part alone
    kl: torch.Tensor  # (B, T) per-token KL estimate to the reference
    advantages: torch.Tensor  # (B, T) GAE, whitened if asked (or a critic-free estimator's), 0 outside response_mask
    returns: torch.Tensor  # (B, T) raw advantages + values: the value targets (critic-free: the raw advantages)
