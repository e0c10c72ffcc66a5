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
    def response_lengths(self) -> torch.Tensor:  # (B,) the policy's tokens (the environment's not counted)
        return self.action_mask.sum(dim=1)


class DeferredOldLogprobs:
    """Old log-probs a rollout left to the update (trainer.defer_old_logprobs), in Rollout.logprobs' place.

    Where nothing reads them before the update and the policy cannot move before each episode's first
    forward in it, that forward's log-probs are the old ones. Each micro-batch of the first epoch hands its
    log-probs to ``take``, which records them; trainer.fill_in_old_logprobs, the one place that turns this
    back into a tensor, reads them once every episode is recorded (or runs the forward itself when the
    update was skipped before any). Never read as log-probs before that.
    """

    def __init__(self, like: torch.Tensor):
        self.logprobs = torch.zeros_like(like)  # (B, T) as Rollout.logprobs once recorded: 0 outside action_mask
        self.recorded = torch.zeros(like.shape[0], dtype=torch.bool, device=like.device)  # (B,) rows taken so far

    def take(self, rows: torch.Tensor, logprobs: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
        """The old log-probs of episodes ``rows`` (M,): the forward's ``logprobs`` (M, T'), T' <= T, detached
        and 0 outside ``action_mask`` (M, T'); recorded, and returned for the loss."""
        old = torch.where(action_mask, logprobs.detach(), 0.0)
        self.logprobs[rows, : old.shape[1]] = old
        self.recorded[rows] = True
        return old

    @property
    def complete(self) -> bool:
        """Every episode recorded (the update's first epoch has run)."""
        return bool(self.recorded.all())


class Rollout(NamedTuple):
    """One PPO batch: what the policy did and what it was worth, all frozen (no grad)."""

    generation: Generation
    prompts: list  # (B,) as read: a string, or a conversation (list of {role, content} messages)
    responses: list[str]
    # (B, T) log pi_old(token), temperature-scaled, 0 outside action_mask; DeferredOldLogprobs when the
    # rollout left them to the update (defer_old_logprobs) until trainer.fill_in_old_logprobs
    logprobs: torch.Tensor | DeferredOldLogprobs
    ref_logprobs: torch.Tensor  # (B, T) log pi_ref(token), same scaling
    values: torch.Tensor  # (B, T) V_old(state before each response token), 0 outside action_mask; NoCritic: all 0
    scores: torch.Tensor  # (B,) total sequence reward: weighted components + penalties; 0 where not scored
    score_components: dict[str, list]  # component name -> per-episode value (penalties included); None: failed
    fixed_value_features: torch.Tensor | None = None  # (B, T, H) a frozen value model's, reused by the update
    sampler_logprobs: torch.Tensor | None = None  # (B, T) a separate sampler's (vLLM) log-probs of the tokens, 0 outside
    scored: torch.Tensor | None = None  # (B,) bool, True where every reward component scored the episode (None: all)
    reward_failures: dict[str, str] | None = None  # component name -> its latest failure this rollout, one line
    episodes: list | None = None  # (B,) envs.multi_turn.EpisodeRecord: the episodes of several turns (None: one turn)

    @property
    def train_mask(self) -> torch.Tensor:  # (B, T)
        """action_mask less the episodes without a reward: what the losses and whitening count."""
        mask = self.generation.action_mask
        return mask if self.scored is None else mask & self.scored.unsqueeze(1)


class Advantages(NamedTuple):
    rewards: torch.Tensor  # (B, T) shaped: -beta*KL per token + score on the last real token
    non_score_rewards: torch.Tensor  # (B, T) the -beta*KL part alone
    kl: torch.Tensor  # (B, T) per-token KL estimate to the reference
    advantages: torch.Tensor  # (B, T) GAE, whitened if asked (or a critic-free estimator's), 0 outside train_mask
    returns: torch.Tensor  # (B, T) raw advantages + values: the value targets (critic-free: the raw advantages)
