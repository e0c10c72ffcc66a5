"""The seam where episodes are produced: a ``Sampler`` turns tokenized prompts into sampled responses.

The Engine holds one, chosen once at load (engine.make_sampler: generation.backend), and every path
that samples (the rollout, held-out evaluation, `ppo rollout / eval / compare`) goes through it.
``TransformersSampler`` (here: transformers' generate, the policy's own forward) and
``vllm_sampler.VllmSampler`` (a separate engine) implement it; a sampler that wraps another (episodes
of several turns) implements the same method and is installed as ``engine.sampler``.

Shapes: B rows, P prompt length (left-padded), T response length (trimmed to the longest response),
H the policy's hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ppo_cli.engine.generate import OnFinished, generate, generate_with_logprobs, trim_padding
from ppo_cli.engine.precision import autocast_context
from ppo_cli.recipe import GenerationConfig
from ppo_cli.types import Generation


@dataclass(frozen=True)
class Sampled:
    """What one ``Sampler.sample`` call gives back."""

    generation: Generation  # trimmed (trim_padding)
    # (B, T) the sampled tokens' log-probs at the sampling temperature, 0 outside action_mask; None when
    # not asked (or not available). A separate engine returns its own whenever they came with the tokens.
    logprobs: torch.Tensor | None
    hidden: torch.Tensor | None  # (B, T, H) policy decoder states that sampled them (for a value head), or None
    # True: from the policy's own forward (usable as old log-probs); False: a separate engine's
    # (vLLM: compared with the policy's, never trained on)
    policy_logprobs: bool


class Sampler(Protocol):
    """Samples one response per prompt row from ``policy`` (global torch RNG: seed it first)."""

    streams: bool  # calls on_finished as rows finish (else ignores it: the reward requests go out after)
    copies_weights: bool  # samples from its own copy of the policy's weights (then they must stay as they are)

    def sample(self, policy, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, with_logprobs: bool = False,
               keep_hidden: bool = False, on_finished: OnFinished | None = None,
               max_new_tokens: int | None = None) -> Sampled:
        """``prompt_ids`` / ``prompt_mask`` (B, P) left-padded; ``with_logprobs`` / ``keep_hidden``: also
        the sampled tokens' log-probs / hidden states; ``on_finished``: told of rows as they finish
        (streaming reward hand-over); ``max_new_tokens``: this call's budget (None: generation.max_new_tokens)."""
        ...

    def close(self) -> None:
        """Free what the sampler holds beyond the policy (an engine, its cache, temporary files)."""
        ...


def weights_fingerprint(named_tensors) -> bytes | None:
    """An exact fingerprint of the values of ``named_tensors`` ((name, tensor) pairs): the blake2b of
    their bytes in order. A sampler holding its own copy of the policy (vLLM's) reloads it only when
    this changes, not before every generate call: an evaluation's batches, dynamic sampling's rounds and
    an episode's turns all sample the same weights. (A tensor's ``_version`` would be cheaper, but a
    fused optimizer step does not bump it.) None for sharded tensors (FSDP's DTensors): always reload."""
    import hashlib

    from torch.distributed.tensor import DTensor

    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in named_tensors:
        if isinstance(tensor, DTensor):
            return None
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy())
    return digest.digest()


def with_budget(gen: GenerationConfig, max_new_tokens: int | None) -> GenerationConfig:
    """The recipe's generation settings, with this call's token budget when one is given."""
    return gen if max_new_tokens is None else gen.model_copy(update={"max_new_tokens": max_new_tokens})


def trimmed(generation: Generation, logprobs: torch.Tensor | None, hidden: torch.Tensor | None,
            policy_logprobs: bool) -> Sampled:
    """A Sampled with the generation's padding columns dropped (trim_padding), the log-probs (B, T)
    cut to the same T and set to 0 outside the action mask (generate's hold the padding's after a
    row's stop token), and the hidden states (B, T, H) cut to T."""
    generation = trim_padding(generation)
    T = generation.response_ids.shape[1]
    if logprobs is not None:
        logprobs = logprobs[:, :T].masked_fill(~generation.action_mask, 0.0)
    return Sampled(generation, logprobs, hidden[:, :T] if hidden is not None else None, policy_logprobs)


class TransformersSampler:
    """generation.backend hf: transformers' generate on the policy itself (engine/generate.py), under
    the run's autocast; its log-probs and hidden states come from generate's own forward passes."""

    streams = True
    copies_weights = False

    def __init__(self, gen: GenerationConfig, stop_token_id: int, pad_token_id: int, mixed_precision: str,
                 device: torch.device):
        self.gen, self.stop_token_id, self.pad_token_id = gen, stop_token_id, pad_token_id
        self.mixed_precision, self.device = mixed_precision, device

    def sample(self, policy, prompt_ids, prompt_mask, *, with_logprobs=False, keep_hidden=False, on_finished=None,
               max_new_tokens=None) -> Sampled:
        args = (policy, prompt_ids, prompt_mask, with_budget(self.gen, max_new_tokens), self.stop_token_id,
                self.pad_token_id)
        with autocast_context(self.mixed_precision, self.device):
            if not (with_logprobs or keep_hidden):
                return trimmed(generate(*args, on_finished), None, None, policy_logprobs=True)
            generation, logprobs, hidden = generate_with_logprobs(*args, keep_hidden=keep_hidden, on_finished=on_finished)
        return trimmed(generation, logprobs if with_logprobs else None, hidden, policy_logprobs=True)

    def close(self) -> None:
        pass
