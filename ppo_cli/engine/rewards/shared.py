"""A reward model that is also the frozen critic: one forward gives the critic's features and the score.

The default critic next to a causal scalar reward model (value.kind auto: the frozen reward-model
critic, engine/critics.py) is that reward model's own backbone, so a rollout would run it twice over
the same tokens: in the reward stack, on the decoded text tokenised again, and for the critic's
features, on the policy's ids. Where the reward's tokenisation of a row gives back the policy's ids
(its real tokens, less a trailing stop token the decoding dropped), the two forwards read the same
tokens at the same positions (positions count real tokens only, whatever the padding), so the score
head at the token the reward model pools gives that row's reward. Rows whose ids differ (sampled
tokens that tokenise another way, truncation at the reward's max_length, a special token the decoding
dropped mid-response) are scored by the reward model's own forward, as before.

The forward runs under the run's autocast, as the reward model's own does (ModelScorer.autocast), so
a row's score is the same whichever forward gives it; the critic's frozen features come from it too.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ppo_cli.engine.logprobs import backbone_hidden, response_slice
from ppo_cli.recipe import ModelReward
from ppo_cli.types import Generation


class SharedForward(NamedTuple):
    features: torch.Tensor  # (B, T, H) the frozen critic's features at the response positions
    scores: list  # (B,) the reward component's value, None for the rows it must score itself
    component: int  # the component's index in the reward stack


class SharedRewardModel:
    """Reward component ``index``, whose model's backbone is the frozen critic's (``find``)."""

    def __init__(self, index: int, scorer):
        self.index, self.scorer = index, scorer

    @classmethod
    def find(cls, reward, actor_critic) -> "SharedRewardModel | None":
        """The scalar reward model whose backbone the frozen critic reads, when one forward can serve
        both: it reads ``text: prompt_and_response`` (the policy's whole sequence; a response alone or
        a chat template's rendering are other tokens), pools as transformers' generic
        ForSequenceClassification (its ``score`` head at the last non-pad token) and has a pad id."""
        from transformers.modeling_layers import GenericForSequenceClassification

        ac = actor_critic
        if ac.value_backbone is None or not ac.value_features_fixed:
            return None
        for index, (_, _, scorer) in enumerate(reward.scorers):
            model = getattr(scorer, "model", None)
            if (isinstance(getattr(scorer, "component", None), ModelReward) and model.base_model is ac.value_backbone
                    and scorer.component.text == "prompt_and_response"
                    and isinstance(model, GenericForSequenceClassification)
                    and model.config.get_text_config().pad_token_id is not None):
                return cls(index, scorer)
        return None

    def score_positions(self, prompts: list, responses: list[str], generation: Generation) -> torch.Tensor:
        """(B,) the position in each policy sequence whose hidden state the reward model's score head
        reads, -1 where the reward's tokens for the row are not the policy's."""
        pad = self.scorer.model.config.get_text_config().pad_token_id
        sequences, mask = generation.sequences.cpu(), generation.attention_mask.cpu()
        positions = []
        for row, ids in enumerate(self.scorer.token_ids(prompts, responses)):
            real = mask[row].nonzero().squeeze(-1)
            policy_ids = sequences[row, real].tolist()
            # decode(skip_special_tokens) drops a special stop token, and only then is it missing here
            if ids and (ids == policy_ids or (generation.finished[row] and ids == policy_ids[:-1])):
                # transformers' pooling: the rightmost non-pad token (argmax of index * non-pad, so 0 if none)
                last = max((k for k, token in enumerate(ids) if token != pad), default=0)
                positions.append(int(real[last]))
            else:
                positions.append(-1)
        return torch.tensor(positions, dtype=torch.long)

    @torch.no_grad()
    def forward(self, generation: Generation, positions: torch.Tensor, chunk: int) -> SharedForward:
        """The reward model's backbone over the policy's sequences, ``chunk`` rows at a time: the
        critic's features (B, T, H) and the score at ``positions`` (rows at -1: None)."""
        model, T = self.scorer.model, generation.response_ids.shape[1]
        sequences, attention_mask = generation.sequences, generation.attention_mask
        features, scores = [], []
        for rows in torch.arange(sequences.shape[0], device=sequences.device).split(chunk):
            at = positions[rows.cpu()].to(sequences.device)
            with self.scorer.autocast():
                hidden = backbone_hidden(model.base_model, sequences[rows], attention_mask[rows])
                pooled = hidden[torch.arange(len(rows), device=hidden.device), at.clamp(min=0)]
                values = model.score(pooled).float()[:, 0].tolist()
            features.append(response_slice(hidden, T).clone())
            scores += [value if p >= 0 else None for value, p in zip(values, at.tolist())]
        return SharedForward(torch.cat(features), scores, self.index)
