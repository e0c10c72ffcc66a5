"""Rows of rollouts: a rollout's episodes chosen by index, and several rollouts made one (ppo.filter_groups
keeps the groups that teach from several sampling rounds). Pure tensor code over types.py's containers.

Rollouts of different widths are padded: prompts on the left (they are left-padded), responses on the right,
with masks False, ids ``pad_token_id`` and every per-token number 0 there, as the engine pads them.
"""

from __future__ import annotations

import torch

from ppo_cli.types import DeferredOldLogprobs, Generation, Rollout


def select_rows(rollout: Rollout, rows: torch.Tensor) -> Rollout:
    """The episodes ``rows`` (K,) (long indices, in that order) of ``rollout``. Old log-probs left to the
    update (DeferredOldLogprobs) must not have been recorded yet: the selection records none either."""
    if isinstance(rollout.logprobs, DeferredOldLogprobs) and rollout.logprobs.recorded.any():
        raise ValueError("select_rows on deferred old log-probs already recorded by an update")
    index = rows.tolist()
    gen = rollout.generation
    generation = Generation(*(field[rows] for field in gen))

    def pick(tensor):
        return None if tensor is None else tensor[rows]

    logprobs = (DeferredOldLogprobs(rollout.ref_logprobs[rows]) if isinstance(rollout.logprobs, DeferredOldLogprobs)
                else rollout.logprobs[rows])
    return Rollout(
        generation, [rollout.prompts[i] for i in index], [rollout.responses[i] for i in index], logprobs,
        rollout.ref_logprobs[rows], rollout.values[rows], rollout.scores[rows],
        {name: [values[i] for i in index] for name, values in rollout.score_components.items()},
        pick(rollout.fixed_value_features), pick(rollout.sampler_logprobs), pick(rollout.scored),
        None if rollout.reward_failures is None else dict(rollout.reward_failures),
        None if rollout.episodes is None else [rollout.episodes[i] for i in index],
    )


def _pad(tensor: torch.Tensor, width: int, value, left: bool = False) -> torch.Tensor:
    """``tensor`` (B, W, ...) padded with ``value`` to (B, width, ...) along dim 1."""
    missing = width - tensor.shape[1]
    if missing == 0:
        return tensor
    pad = torch.full((tensor.shape[0], missing, *tensor.shape[2:]), value, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([pad, tensor] if left else [tensor, pad], dim=1)


def concat_rollouts(parts: list[Rollout], pad_token_id: int) -> Rollout:
    """The episodes of ``parts`` one after another, as one rollout: (sum B, max P) prompts left-padded,
    (sum B, max T) responses right-padded. ``scored`` is None only when every part's is (each None counts
    as all scored); ``reward_failures`` keeps each component's latest line. Deferred old log-probs (none
    recorded) stay deferred."""
    if not parts:
        raise ValueError("concat_rollouts needs at least one rollout")
    if len(parts) == 1:
        return parts[0]
    P = max(p.generation.prompt_ids.shape[1] for p in parts)
    T = max(p.generation.response_ids.shape[1] for p in parts)

    def cat(tensors, width, value, left=False):
        return torch.cat([_pad(t, width, value, left) for t in tensors])

    gens = [p.generation for p in parts]
    generation = Generation(
        cat([g.prompt_ids for g in gens], P, pad_token_id, left=True),
        cat([g.prompt_mask for g in gens], P, False, left=True),
        cat([g.response_ids for g in gens], T, pad_token_id),
        cat([g.response_mask for g in gens], T, False),
        torch.cat([g.finished for g in gens]),
        cat([g.action_mask for g in gens], T, False),
    )
    deferred = [isinstance(p.logprobs, DeferredOldLogprobs) for p in parts]
    if any(deferred) and not all(deferred):
        raise ValueError("concat_rollouts: deferred and computed old log-probs cannot be mixed")
    if any(d.recorded.any() for d, is_deferred in zip((p.logprobs for p in parts), deferred) if is_deferred):
        raise ValueError("concat_rollouts on deferred old log-probs already recorded by an update")
    ref_logprobs = cat([p.ref_logprobs for p in parts], T, 0.0)
    logprobs = DeferredOldLogprobs(ref_logprobs) if all(deferred) else cat([p.logprobs for p in parts], T, 0.0)

    def optional(name):
        tensors = [getattr(p, name) for p in parts]
        if all(t is None for t in tensors):
            return None
        if any(t is None for t in tensors):
            raise ValueError(f"concat_rollouts: {name} is missing from some of the rollouts")
        return cat(tensors, T, 0.0)

    return Rollout(
        generation, [x for p in parts for x in p.prompts], [x for p in parts for x in p.responses], logprobs,
        ref_logprobs, cat([p.values for p in parts], T, 0.0), torch.cat([p.scores for p in parts]),
        concat_components(parts), optional("fixed_value_features"), optional("sampler_logprobs"),
        concat_scored(parts), merge_failures(parts),
        None if all(p.episodes is None for p in parts) else [e for p in parts for e in (p.episodes or [None] * len(p.prompts))],
    )


def concat_scored(parts) -> torch.Tensor | None:
    """The parts' ``scored`` (B_i,) one after another; None only when every part's is None (all scored).
    ``parts``: anything with ``scores`` and ``scored`` (a Rollout, train_metrics.ScoredEpisodes)."""
    if all(p.scored is None for p in parts):
        return None
    return torch.cat([p.scored if p.scored is not None else torch.ones_like(p.scores, dtype=torch.bool) for p in parts])


def concat_components(parts) -> dict[str, list]:
    """Each reward component's values over the parts, one after another (the same components in each)."""
    return {name: [v for p in parts for v in p.score_components[name]] for name in parts[0].score_components}


def merge_failures(parts) -> dict[str, str] | None:
    """Each failable component's latest failure line over the parts ('' where none failed); None when no part has any."""
    if all(p.reward_failures is None for p in parts):
        return None
    failures: dict[str, str] = {}
    for p in parts:
        failures.update({k: v for k, v in (p.reward_failures or {}).items() if v or k not in failures})
    return failures
