"""Each update's metrics, from what its phases produced: the rollout (TRL's objective/* names, the
reward components), the optimisation (UpdateStats, averaged per micro-batch) and the speed (MFU,
decode bandwidth). Plain floats out, gathered over every process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ppo_cli import metric_names as names
from ppo_cli.algo.group import group_reward_stats
from ppo_cli.algo.losses import explained_variance
from ppo_cli.algo.masking import masked_mean
from ppo_cli.distributed import Distributed
from ppo_cli.perf import decode_gbps, mfu, rollout_flops, update_flops
from ppo_cli.stats import distinct_n
from ppo_cli.train_setup import TrainState
from ppo_cli.types import Advantages, Rollout


@dataclass
class UpdateStats:
    """Per micro-batch statistics, averaged for the metrics (TRL's *_avg)."""

    values: dict[str, list[float]] = field(default_factory=dict)
    epochs_run: int = 0
    micro_batches_per_step: int = 1  # the first this many entries come before any optimizer step
    grad_norms: list[float] = field(default_factory=list)
    optimizer_steps: int = 0
    skipped_steps: int = 0  # optimizer steps dropped for a non-finite loss or gradient

    def add(self, **stats: torch.Tensor) -> None:
        for name, value in stats.items():
            self.values.setdefault(name, []).append(float(value.detach()))

    def mean(self, name: str) -> float:
        return sum(self.values[name]) / len(self.values[name])


def rollout_metrics(rollout: Rollout, adv: Advantages, kl_coef: float, dist: Distributed,
                    group_size: int = 1, *, critic_trains: bool) -> dict[str, float]:
    """TRL's objective/* names: sums over the policy's tokens (action_mask), means over the episodes of all processes."""
    mask = rollout.generation.action_mask
    scored = rollout.scored if rollout.scored is not None else torch.ones_like(rollout.scores, dtype=torch.bool)
    scores = dist.gather(rollout.scores)[dist.gather(scored.float()) > 0]  # the episodes that have a reward
    kl_sum = dist.gather(adv.kl.sum(dim=1))
    non_score = dist.gather(adv.non_score_rewards.sum(dim=1))
    all_mask = dist.gather(mask)
    responses = [r for part in dist.gather_objects(rollout.responses) for r in part]
    metrics = {
        names.OBJECTIVE_KL: kl_sum.mean().item(),
        names.OBJECTIVE_ENTROPY: dist.gather((-rollout.logprobs * mask).sum(dim=1)).mean().item(),
        names.OBJECTIVE_NON_SCORE_REWARD: non_score.mean().item(),
        names.OBJECTIVE_RLHF_REWARD: non_score.mean().item() + (scores.mean().item() if len(scores) else float("nan")),
        names.OBJECTIVE_SCORES: scores.mean().item() if len(scores) else float("nan"),
        names.OBJECTIVE_SCORES_STD: scores.std().item() if len(scores) > 1 else 0.0,
        names.OBJECTIVE_KL_COEF: kl_coef,
        names.EOS_RATE: dist.gather(rollout.generation.finished.float()).mean().item(),
        names.RESPONSE_LENGTH: dist.gather(mask.sum(dim=1).float()).mean().item(),
        names.SAMPLES_DISTINCT_1: distinct_n(responses, 1),
        names.SAMPLES_DISTINCT_2: distinct_n(responses, 2),
    }
    if critic_trains:  # NoCritic's values are zeros: nothing to measure
        values, returns = dist.gather(rollout.values), dist.gather(adv.returns)
        metrics[names.VAL_EXPLAINED_VARIANCE] = float(explained_variance(values, returns, all_mask))
        metrics[names.VAL_MEAN] = masked_mean(values, all_mask).item()
    if group_size > 1:
        # TRL's names. A group whose completions all score the same gives them all advantage 0 (grpo, rloo).
        group_std = dist.gather(group_reward_stats(rollout.scores, group_size).group_std)
        metrics[names.REWARD_STD] = group_std.mean().item()
        metrics[names.FRAC_REWARD_ZERO_STD] = (group_std == 0).float().mean().item()
    if rollout.sampler_logprobs is not None:
        # How far the sampler's (vLLM's) distribution is from the policy's own forward, per token.
        diff = dist.gather((rollout.logprobs - rollout.sampler_logprobs).abs())[all_mask]
        metrics[names.ROLLOUT_LOGPROB_DIFF_MEAN] = diff.mean().item() if diff.numel() else 0.0
        metrics[names.ROLLOUT_LOGPROB_DIFF_MAX] = diff.max().item() if diff.numel() else 0.0
    metrics.update(reward_component_metrics(rollout, dist))
    return metrics


class ScoredEpisodes(NamedTuple):
    """What the reward metrics read of the episodes an update generated (ppo.filter_groups: every sampling
    round's, the dropped groups' too), without their tensors per token. Fields as Rollout's, (E,) each."""

    scores: torch.Tensor
    score_components: dict[str, list]
    scored: torch.Tensor | None
    reward_failures: dict[str, str] | None


def generated_reward_metrics(episodes: ScoredEpisodes, non_score_reward: float, dist: Distributed,
                             group_size: int) -> dict[str, float]:
    """The reward metrics of rollout_metrics (objective/scores, its std, objective/rlhf_reward, reward_std,
    frac_reward_zero_std, reward/*) over every generated episode, so that a run which trains on the groups
    that scored apart still shows its true success rate. ``non_score_reward``: the trained episodes' mean."""
    scored = episodes.scored if episodes.scored is not None else torch.ones_like(episodes.scores, dtype=torch.bool)
    scores = dist.gather(episodes.scores)[dist.gather(scored.float()) > 0]
    mean_score = scores.mean().item() if len(scores) else float("nan")
    group_std = dist.gather(group_reward_stats(episodes.scores, group_size).group_std)
    return {
        names.OBJECTIVE_SCORES: mean_score,
        names.OBJECTIVE_SCORES_STD: scores.std().item() if len(scores) > 1 else 0.0,
        names.OBJECTIVE_RLHF_REWARD: non_score_reward + mean_score,
        names.REWARD_STD: group_std.mean().item(),
        names.FRAC_REWARD_ZERO_STD: (group_std == 0).float().mean().item(),
        **reward_component_metrics(episodes, dist),
    }


def reward_component_metrics(rollout: Rollout | ScoredEpisodes, dist: Distributed) -> dict[str, float]:
    """reward/NAME: each component's mean over the episodes it scored; reward/failed_rate/NAME: the
    fraction it failed to score and that no other component scored either (the components that can fail:
    functions, servers, judges);
    reward/failed_rate: the episodes without a reward (they left the update)."""
    metrics = {}
    device = rollout.scores.device
    unscored = [not s for s in rollout.scored.tolist()] if rollout.scored is not None else [False] * len(rollout.scores)
    for name, component in rollout.score_components.items():
        missing = dist.gather(torch.tensor([v is None for v in component], dtype=torch.float64, device=device))
        # a function's None that another component covered is "does not apply" (stack.combine_components), not a failure
        failed = dist.gather(torch.tensor([v is None and u for v, u in zip(component, unscored)], dtype=torch.float64,
                                          device=device))
        values = dist.gather(torch.tensor([0.0 if v is None else v for v in component], dtype=torch.float64, device=device))
        kept = values[missing == 0]
        metrics[names.reward_component(name)] = kept.mean().item() if len(kept) else float("nan")
        if name in (rollout.reward_failures or {}):
            metrics[names.reward_component_failed_rate(name)] = failed.mean().item()
    if rollout.scored is not None:
        metrics[names.REWARD_FAILED_RATE] = 1.0 - dist.gather(rollout.scored.double()).mean().item()
    return metrics


def update_metrics(stats: UpdateStats, dist: Distributed) -> dict[str, float]:
    first = stats.values["ratio"][: stats.micro_batches_per_step]
    metrics = {
        names.POLICY_APPROXKL_AVG: dist.mean_of(stats.mean("approx_kl")),
        names.POLICY_CLIPFRAC_AVG: dist.mean_of(stats.mean("clipfrac")),
        # by direction (TRL's clip_ratio/low_mean, high_mean): ratio below 1 - eps on A < 0, above 1 + eps_high on A > 0
        names.POLICY_CLIPFRAC_LOW: dist.mean_of(stats.mean("clipfrac_low")),
        names.POLICY_CLIPFRAC_HIGH: dist.mean_of(stats.mean("clipfrac_high")),
        names.POLICY_ENTROPY_AVG: dist.mean_of(stats.mean("entropy")),
        names.LOSS_POLICY_AVG: dist.mean_of(stats.mean("policy_loss")),
        names.VAL_RATIO: dist.mean_of(stats.mean("ratio")),
        # Before the first optimizer step the policy is the rollout policy, so this is 1 up to numerics;
        # far from 1 means rollout and update compute log-probs differently (e.g. a missing temperature).
        names.VAL_RATIO_FIRST_MINIBATCH: dist.mean_of(sum(first) / len(first)),
        names.PPO_EPOCHS_RUN: stats.epochs_run,
        names.PPO_SKIPPED_STEPS: stats.skipped_steps,
    }
    if "value_loss" in stats.values:  # a critic trained
        metrics[names.LOSS_VALUE_AVG] = dist.mean_of(stats.mean("value_loss"))
        metrics[names.VAL_CLIPFRAC_AVG] = dist.mean_of(stats.mean("value_clipfrac"))
    if "kl_loss" in stats.values:  # ppo.kl_penalty loss: the k3 term before kl_coef
        metrics[names.LOSS_KL_AVG] = dist.mean_of(stats.mean("kl_loss"))
    if "entropy_threshold" in stats.values:  # ppo.top_entropy_quantile < 1: the entropy a trained token had at least
        metrics[names.POLICY_ENTROPY_THRESHOLD] = dist.mean_of(stats.mean("entropy_threshold"))
    if stats.grad_norms:
        metrics[names.POLICY_GRAD_NORM] = sum(stats.grad_norms) / len(stats.grad_norms)
    return metrics


def perf_metrics(state: TrainState, generation, rollout_seconds: float, update_seconds: float) -> dict[str, float]:
    """perf/mfu_rollout and perf/mfu_update (against the probe's measured matmul peak; only where the
    probe ran, on CPU) and perf/decode_gbps (the policy's weights read per decode step / generation time)."""
    sizes, engine = state.sizes, state.engine
    if sizes is None:
        return {}
    out = {}
    if engine.generation_seconds > 0:
        out[names.PERF_DECODE_GBPS] = decode_gbps(sizes.policy_bytes, generation.response_ids.shape[1], engine.generation_seconds)
    probe = state.dist.precision.probe
    if probe is not None:
        weights = next(engine.actor_critic.policy.parameters()).dtype
        half = state.dist.mixed_precision != "no" or weights in (torch.bfloat16, torch.float16)
        peak = probe.peak_flops("bf16" if half else "no")
        sequence_tokens = generation.sequences.numel()
        prompt_tokens, generated = int(generation.prompt_mask.sum()), int(generation.action_mask.sum())
        out[names.PERF_MFU_ROLLOUT] = mfu(rollout_flops(sizes, prompt_tokens, generated, sequence_tokens), rollout_seconds, peak)
        out[names.PERF_MFU_UPDATE] = mfu(update_flops(sizes, sequence_tokens, state.recipe.ppo.ppo_epochs), update_seconds, peak)
    return out
