"""The PPO loop, in the order of the algorithm (cleanrl's ppo.py is the model):

    for each update:
        rollout    sample prompts, generate, old/ref log-probs, old values, scores
        advantages per-token rewards = score on the last token - beta * KL; GAE; whiten
                   (critic-free: per group of a prompt's completions, GRPO / RLOO / REINFORCE++)
        optimise   ppo_epochs x shuffled minibatches x micro-batches (grad accumulation):
                   clipped surrogate + vf_coef * clipped value loss - entropy_coef * entropy
                   (critic-free: no value term; GRPO's + beta * k3 KL with ppo.kl_penalty loss)
        adapt      KL controller, LR schedule; log metrics
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ppo_cli.algo.advantages import compute_gae, shape_rewards
from ppo_cli.algo.aggregation import aggregate_loss
from ppo_cli.algo.group import group_normalized_advantages, group_reward_stats, rloo_advantages
from ppo_cli.algo.importance import truncated_is_weights
from ppo_cli.algo.kl import AdaptiveKLController, FixedKLController, kl_penalty
from ppo_cli.algo.losses import clipped_policy_loss, clipped_value_loss, entropy_from_logits, explained_variance
from ppo_cli.algo.masking import global_masked_mean_var, mask_truncated_completions, masked_mean, masked_whiten
from ppo_cli.algo.reinforce import reinforce_plus_plus_advantages, reinforce_plus_plus_baseline_advantages
from ppo_cli.collectives import enter as enter_phase
from ppo_cli.distributed import Distributed, configure_deepspeed, mark_accumulation_boundary
from ppo_cli.engine.actor_critic import PolicyAndValue
from ppo_cli.engine.data import PromptSampler
from ppo_cli.engine.logprobs import selective_log_softmax
from ppo_cli.engine.engine import Engine
from ppo_cli.memory_peaks import phase_peak
from ppo_cli.resource_errors import phase as memory_phase
from ppo_cli.perf import ModelSizes, decode_gbps, mfu, rollout_flops, update_flops
from ppo_cli.recipe import OptimConfig, PPOConfig, Recipe
from ppo_cli.stats import distinct_n
from ppo_cli.types import Advantages, Rollout

GRPO_EPS = 1e-4  # added to the std GRPO divides by (TRL's epsilon; verl's is 1e-6)

# --- setup ---------------------------------------------------------------------------------------


def make_kl_controller(ppo: PPOConfig):
    if ppo.adaptive_kl is None:
        return FixedKLController(ppo.kl_coef)
    return AdaptiveKLController(ppo.kl_coef, ppo.adaptive_kl.target, ppo.adaptive_kl.horizon)


def make_optimizer(engine: Engine, optim: OptimConfig) -> torch.optim.Optimizer:
    ac = engine.actor_critic
    groups = [{"params": ac.policy_parameters(), "lr": optim.lr}]
    if value_parameters := ac.value_parameters():  # NoCritic has none: no second group (DeepSpeed and FSDP flatten each group)
        groups.append({"params": value_parameters, "lr": optim.value_lr or ac.default_value_lr(optim.lr)})
    if optim.name != "adamw":
        import bitsandbytes as bnb

        # Tensors under 4096 elements (the value head, biases) keep 32-bit states: bitsandbytes' rule.
        cls = bnb.optim.AdamW8bit if optim.name == "adamw_8bit" else bnb.optim.PagedAdamW8bit
        return cls(groups, weight_decay=optim.weight_decay, eps=optim.adam_eps)
    # The fused kernel exists for CUDA and CPU; on CPU it is ~7x faster than the default for-loop
    # (docs/benchmarks.md), which dominates a full fine-tune's optimizer step.
    fused_ok = engine.device.type in ("cuda", "cpu")
    return torch.optim.AdamW(groups, weight_decay=optim.weight_decay, eps=optim.adam_eps, fused=fused_ok or None)


def make_scheduler(optimizer, optim: OptimConfig, total_updates: int):
    """LR multiplier per update: linear warmup, then constant, linear or cosine decay to 0."""

    def factor(update: int) -> float:
        if update < optim.warmup_steps:
            return (update + 1) / (optim.warmup_steps + 1)
        progress = (update - optim.warmup_steps) / max(1, total_updates - optim.warmup_steps)
        if optim.scheduler == "linear":
            return max(0.0, 1.0 - progress)
        if optim.scheduler == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# --- phase 2: advantages -------------------------------------------------------------------------


def compute_advantages(rollout: Rollout, kl_coef: float, ppo: PPOConfig, reduce_sum=None,
                       group_size: int = 1) -> Advantages:
    """``reduce_sum`` sums across processes, so whitening uses the global batch's statistics.
    ``group_size``: completions per prompt, contiguous in the rollout (generation.num_generations).
    Episodes without a reward (rollout.scored False) take no part: their advantages are 0 and they
    count in no whitening statistic."""
    if rollout.logprobs is None:  # left to the update (defer_old_logprobs): the KL is in the loss, nothing here reads it
        kl = torch.zeros_like(rollout.ref_logprobs)
    else:
        kl = kl_penalty(rollout.logprobs, rollout.ref_logprobs, ppo.kl_estimator).masked_fill(~rollout.generation.response_mask, 0.0)
    mask = rollout.train_mask
    if ppo.critic_free:
        return critic_free_advantages(rollout, kl, 0.0 if ppo.kl_in_loss else kl_coef, ppo, reduce_sum, group_size)
    if ppo.kl_in_loss:
        kl_coef = 0.0
    rewards, non_score_rewards = shape_rewards(rollout.scores, kl, kl_coef, mask)
    if ppo.whiten_rewards:
        rewards = masked_whiten(rewards, mask, keep_mean=True, reduce_sum=reduce_sum)
    advantages, returns = compute_gae(rewards, rollout.values, mask, ppo.gamma, ppo.gae_lambda)
    if ppo.whiten_advantages:
        advantages = masked_whiten(advantages, mask, reduce_sum=reduce_sum)
    return Advantages(rewards, non_score_rewards, kl, advantages, returns)


def critic_free_advantages(rollout: Rollout, kl: torch.Tensor, kl_coef: float, ppo: PPOConfig, reduce_sum,
                           group_size: int) -> Advantages:
    """GRPO, RLOO (a sequence advantage on every response token) or REINFORCE++ (token returns).
    ``kl_coef`` 0 when the KL goes into the loss instead. grpo and rloo subtract the KL summed over the
    response from the score (TRL's RLOO: rlhf_reward = score - kl_coef * kl.sum); reinforce_pp puts it
    on every token. Groups are whole on each process (train_step repeats prompts after splitting them),
    so only reinforce_pp's whitening needs the other processes."""
    mask = rollout.train_mask
    rewards, non_score_rewards = shape_rewards(rollout.scores, kl, kl_coef, mask)
    if ppo.advantage == "reinforce_pp":
        if group_size > 1:
            advantages, returns = reinforce_plus_plus_baseline_advantages(
                rollout.scores, kl, kl_coef, mask, group_size, ppo.gamma, reduce_sum)
        else:
            advantages, returns = reinforce_plus_plus_advantages(rollout.scores, kl, kl_coef, mask, ppo.gamma, reduce_sum)
        return Advantages(rewards, non_score_rewards, kl, advantages, returns)
    sequence_rewards = rollout.scores + non_score_rewards.sum(dim=1)
    if ppo.advantage == "grpo" and ppo.scale_rewards == "batch" and reduce_sum is not None:
        # the std of every process's scores (TRL gathers them); a constant group stays exactly 0
        centred = group_normalized_advantages(sequence_rewards, group_size, "none")
        _, var = global_masked_mean_var(sequence_rewards.unsqueeze(1), torch.ones_like(mask[:, :1]), reduce_sum)
        sequence = centred / (var.sqrt() + GRPO_EPS)
    elif ppo.advantage == "grpo":
        sequence = group_normalized_advantages(sequence_rewards, group_size, ppo.scale_rewards, GRPO_EPS)
    else:
        sequence = rloo_advantages(sequence_rewards, group_size)
    advantages = (sequence.unsqueeze(1) * mask).to(rewards.dtype)
    return Advantages(rewards, non_score_rewards, kl, advantages, advantages)


# --- phase 3: optimise ---------------------------------------------------------------------------


@dataclass
class UpdateStats:
    """Per micro-batch statistics, averaged for the metrics (TRL's *_avg)."""

    values: dict[str, list[float]] = field(default_factory=dict)
    epochs_run: int = 0
    micro_batches_per_step: int = 1  # the first this many entries come before any optimizer step
    grad_norms: list[float] = field(default_factory=list)
    optimizer_steps: int = 0
    skipped_steps: int = 0  # optimizer steps dropped for a non-finite loss or gradient
    # (B, T) the old log-probs the first epoch computed, when the rollout left them out (defer_old_logprobs)
    old_logprobs: torch.Tensor | None = None

    def add(self, **stats: torch.Tensor) -> None:
        for name, value in stats.items():
            self.values.setdefault(name, []).append(float(value.detach()))

    def mean(self, name: str) -> float:
        return sum(self.values[name]) / len(self.values[name])


def micro_batch_loss(state: "TrainState", rollout: Rollout, adv: Advantages, rows: torch.Tensor, stats: UpdateStats):
    """Loss on a few episodes, trimmed to their longest response (padding costs no compute)."""
    ppo, gen = state.recipe.ppo, rollout.generation
    T = max(1, int(gen.response_mask[rows].sum(dim=1).max()))
    response_ids = gen.response_ids[rows, :T]
    sequences = torch.cat([gen.prompt_ids[rows], response_ids], dim=1)
    attention_mask = torch.cat([gen.prompt_mask[rows], gen.response_mask[rows, :T]], dim=1)
    mask = rollout.train_mask[rows, :T]  # episodes without a reward leave the loss

    fixed = rollout.fixed_value_features
    # The rollout's autocast, explicitly: accelerate autocasts a prepared model's forward under DDP but
    # not under FSDP2, whose update would then compute in float32 and the first ratio would not be 1.
    with state.engine.autocast():
        logits, values = state.model(sequences, attention_mask, T, state.recipe.generation.temperature,
                                     None if fixed is None else fixed[rows, :T])
    logprobs = selective_log_softmax(logits, response_ids)
    if rollout.logprobs is None:  # the policy has not moved since the rollout: its old log-probs are these
        old_logprobs = torch.where(gen.response_mask[rows, :T], logprobs.detach(), 0.0)
        stats.old_logprobs[rows, :T] = old_logprobs
    else:
        old_logprobs = rollout.logprobs[rows, :T]
    loss_mask = mask_truncated_completions(mask, gen.finished[rows]) if ppo.mask_truncated else mask
    weights = None
    if ppo.rollout_is_clip is not None and rollout.sampler_logprobs is not None:  # a separate sampler drew them
        weights = truncated_is_weights(old_logprobs, rollout.sampler_logprobs[rows, :T], gen.response_mask[rows, :T],
                                       ppo.rollout_is_clip)
    max_len = state.recipe.generation.max_new_tokens
    policy = clipped_policy_loss(logprobs, old_logprobs, adv.advantages[rows, :T], loss_mask,
                                 ppo.cliprange, token_weights=weights, cliprange_high=ppo.cliprange_high,
                                 ratio_level=ppo.ratio_level, loss_agg_mode=ppo.loss_aggregation,
                                 max_response_length=max_len)
    with torch.set_grad_enabled(ppo.entropy_coef > 0):
        entropy = masked_mean(entropy_from_logits(logits), mask)
    if not state.engine.actor_critic.critic.trains:  # value.kind none: its values are zeros, no value loss
        loss = policy.loss - ppo.entropy_coef * entropy
    else:
        value = clipped_value_loss(values, rollout.values[rows, :T], adv.returns[rows, :T], mask, ppo.cliprange_value)
        loss = policy.loss + ppo.vf_coef * value.loss - ppo.entropy_coef * entropy
        stats.add(value_loss=value.loss, value_clipfrac=value.clipfrac)
    if ppo.kl_in_loss:  # GRPO: beta * k3(policy || reference) per token, aggregated as the policy loss
        # Padding zeroed before the exp: exp(ref - logprob) of a padding token can overflow, and its
        # inf would reach the gradient as 0 * inf = NaN through a where() after it.
        ref_kl = kl_penalty(torch.where(loss_mask, logprobs, 0), torch.where(loss_mask, rollout.ref_logprobs[rows, :T], 0), "k3")
        kl_loss = aggregate_loss(ref_kl, loss_mask, ppo.loss_aggregation, max_len)
        loss = loss + state.kl_controller.value * kl_loss
        stats.add(kl_loss=kl_loss)
    stats.add(
        policy_loss=policy.loss, approx_kl=policy.approx_kl, clipfrac=policy.clipfrac, ratio=policy.ratio_mean,
        clipfrac_low=policy.clipfrac_low, clipfrac_high=policy.clipfrac_high, entropy=entropy,
    )
    return loss


def token_budget_micro_batches(rows: torch.Tensor, response_lengths: torch.Tensor, prompt_len: int,
                               budget: int) -> list[torch.Tensor]:
    """Split a mini-batch's episode indices into micro-batches of at most ``budget`` padded tokens.

    rows (M,) episode indices, response_lengths (M,) their real response lengths. A micro-batch of n
    episodes costs n x (prompt_len + its longest response), as micro_batch_loss trims it. Filled
    longest first, so each micro-batch holds responses of similar length.
    """
    batches, current, width = [], [], 0
    for i in response_lengths.argsort(descending=True, stable=True).tolist():
        if current and (len(current) + 1) * width > budget:
            batches.append(rows[current])
            current = []
        if not current:  # longest first: a micro-batch's first episode sets its width
            width = prompt_len + max(1, int(response_lengths[i]))
        current.append(i)
    return batches + [rows[current]]


def split_micro_batches(mini_batch: torch.Tensor, rollout: Rollout, ppo: PPOConfig) -> list[torch.Tensor]:
    if ppo.micro_batch_tokens is None:
        return list(mini_batch.split(ppo.micro_batch_size))
    gen = rollout.generation
    lengths = gen.response_mask[mini_batch].sum(dim=1)
    return token_budget_micro_batches(mini_batch, lengths, gen.prompt_ids.shape[1], ppo.micro_batch_tokens)


def optimise(state: "TrainState", rollout: Rollout, adv: Advantages) -> UpdateStats:
    ppo, max_grad_norm, optimizer = state.recipe.ppo, state.recipe.optim.max_grad_norm, state.optimizer
    accelerator = state.dist.accelerator
    params = [p for group in optimizer.param_groups for p in group["params"]]
    batch_size, stats = len(rollout.prompts), UpdateStats()
    if rollout.logprobs is None:
        if ppo.mini_batch_size < batch_size:
            raise ValueError("old log-probs left to the update need one mini-batch per epoch (defer_old_logprobs)")
        stats.old_logprobs = torch.zeros_like(rollout.ref_logprobs)
    for epoch in range(ppo.ppo_epochs):
        if epoch == 1 and stats.old_logprobs is not None:  # every episode has been through the first forward
            rollout = rollout._replace(logprobs=stats.old_logprobs)
        epoch_start = len(stats.values.get("approx_kl", []))
        order = torch.randperm(batch_size, device=state.engine.device)
        for index_in_epoch, mini_batch in enumerate(order.split(ppo.mini_batch_size)):
            optimizer.zero_grad(set_to_none=True)
            micro_batches = split_micro_batches(mini_batch, rollout, ppo)
            if epoch == 0 and index_in_epoch == 0:
                stats.micro_batches_per_step = len(micro_batches)
            for index, rows in enumerate(micro_batches):
                # Gradients are averaged across processes once per mini-batch, not per micro-batch.
                sync = index == len(micro_batches) - 1
                mark_accumulation_boundary(accelerator, sync)
                with contextlib.nullcontext() if sync else accelerator.no_sync(state.model):
                    loss = micro_batch_loss(state, rollout, adv, rows, stats)
                    # Each micro-batch's loss is a mean over its own tokens: weight it by its share of
                    # the mini-batch's episodes (1 / grad_accum_steps when all are the same size).
                    accelerator.backward(loss / (len(mini_batch) / len(rows)))
            grad_norm = state.dist.clip_grad_norm_(params, max_grad_norm or float("inf"))
            # One NaN step would poison the weights for good: drop it. (After the all-reduce the
            # gradients, hence their norm, are the same on every process, so all of them agree.)
            # DeepSpeed clips and steps inside its engine (in the last backward) and reports its norm
            # as a float, or None.
            grad_norm = torch.zeros(()) if grad_norm is None else torch.as_tensor(grad_norm)
            if not torch.isfinite(grad_norm):
                stats.skipped_steps += 1
                if accelerator.scaler is not None:
                    # fp16: the loss scale overflowed; the scaler's step skips the update and lowers
                    # the scale (without it the scale would stay too high and every step would skip).
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                continue
            stats.grad_norms.append(float(grad_norm))
            optimizer.step()
            stats.optimizer_steps += 1
        stats.epochs_run = epoch + 1
        epoch_kl = stats.values["approx_kl"][epoch_start:]
        # Stop reusing this batch once the policy has moved too far from the rollout policy.
        if ppo.max_kl is not None and state.dist.mean_of(sum(epoch_kl) / len(epoch_kl)) > ppo.max_kl:
            break
    optimizer.zero_grad(set_to_none=True)
    return stats


# --- metrics -------------------------------------------------------------------------------------


def rollout_metrics(rollout: Rollout, adv: Advantages, kl_coef: float, dist: Distributed,
                    group_size: int = 1, *, critic_trains: bool) -> dict[str, float]:
    """TRL's objective/* names: sums over response tokens, means over the episodes of all processes."""
    mask = rollout.generation.response_mask
    scored = rollout.scored if rollout.scored is not None else torch.ones_like(rollout.scores, dtype=torch.bool)
    scores = dist.gather(rollout.scores)[dist.gather(scored.float()) > 0]  # the episodes that have a reward
    kl_sum = dist.gather(adv.kl.sum(dim=1))
    non_score = dist.gather(adv.non_score_rewards.sum(dim=1))
    all_mask = dist.gather(mask)
    responses = [r for part in dist.gather_objects(rollout.responses) for r in part]
    metrics = {
        "objective/kl": kl_sum.mean().item(),
        "objective/entropy": dist.gather((-rollout.logprobs * mask).sum(dim=1)).mean().item(),
        "objective/non_score_reward": non_score.mean().item(),
        "objective/rlhf_reward": non_score.mean().item() + (scores.mean().item() if len(scores) else float("nan")),
        "objective/scores": scores.mean().item() if len(scores) else float("nan"),
        "objective/scores_std": scores.std().item() if len(scores) > 1 else 0.0,
        "objective/kl_coef": kl_coef,
        "eos_rate": dist.gather(rollout.generation.finished.float()).mean().item(),
        "response_length": dist.gather(mask.sum(dim=1).float()).mean().item(),
        "samples/distinct_1": distinct_n(responses, 1),
        "samples/distinct_2": distinct_n(responses, 2),
    }
    if critic_trains:  # NoCritic's values are zeros: nothing to measure
        values, returns = dist.gather(rollout.values), dist.gather(adv.returns)
        metrics["val/explained_variance"] = float(explained_variance(values, returns, all_mask))
        metrics["val/mean"] = masked_mean(values, all_mask).item()
    if group_size > 1:
        # TRL's names. A group whose completions all score the same gives them all advantage 0 (grpo, rloo).
        group_std = dist.gather(group_reward_stats(rollout.scores, group_size).group_std)
        metrics["reward_std"] = group_std.mean().item()
        metrics["frac_reward_zero_std"] = (group_std == 0).float().mean().item()
    if rollout.sampler_logprobs is not None:
        # How far the sampler's (vLLM's) distribution is from the policy's own forward, per token.
        diff = dist.gather((rollout.logprobs - rollout.sampler_logprobs).abs())[all_mask]
        metrics["rollout/logprob_diff_mean"] = diff.mean().item() if diff.numel() else 0.0
        metrics["rollout/logprob_diff_max"] = diff.max().item() if diff.numel() else 0.0
    metrics.update(reward_component_metrics(rollout, dist))
    return metrics


def reward_component_metrics(rollout: Rollout, dist: Distributed) -> dict[str, float]:
    """reward/NAME: each component's mean over the episodes it scored; reward/failed_rate/NAME: the
    fraction it failed to score (the components that can fail: functions, servers, judges);
    reward/failed_rate: the episodes without a reward (they left the update)."""
    metrics = {}
    device = rollout.scores.device
    for name, component in rollout.score_components.items():
        failed = dist.gather(torch.tensor([v is None for v in component], dtype=torch.float64, device=device))
        values = dist.gather(torch.tensor([0.0 if v is None else v for v in component], dtype=torch.float64, device=device))
        kept = values[failed == 0]
        metrics[f"reward/{name}"] = kept.mean().item() if len(kept) else float("nan")
        if name in (rollout.reward_failures or {}):
            metrics[f"reward/failed_rate/{name}"] = failed.mean().item()
    if rollout.scored is not None:
        metrics["reward/failed_rate"] = 1.0 - dist.gather(rollout.scored.double()).mean().item()
    return metrics


def update_metrics(stats: UpdateStats, dist: Distributed) -> dict[str, float]:
    first = stats.values["ratio"][: stats.micro_batches_per_step]
    metrics = {
        "policy/approxkl_avg": dist.mean_of(stats.mean("approx_kl")),
        "policy/clipfrac_avg": dist.mean_of(stats.mean("clipfrac")),
        # by direction (TRL's clip_ratio/low_mean, high_mean): ratio below 1 - eps on A < 0, above 1 + eps_high on A > 0
        "policy/clipfrac_low": dist.mean_of(stats.mean("clipfrac_low")),
        "policy/clipfrac_high": dist.mean_of(stats.mean("clipfrac_high")),
        "policy/entropy_avg": dist.mean_of(stats.mean("entropy")),
        "loss/policy_avg": dist.mean_of(stats.mean("policy_loss")),
        "val/ratio": dist.mean_of(stats.mean("ratio")),
        # Before the first optimizer step the policy is the rollout policy, so this is 1 up to numerics;
        # far from 1 means rollout and update compute log-probs differently (e.g. a missing temperature).
        "val/ratio_first_minibatch": dist.mean_of(sum(first) / len(first)),
        "ppo/epochs_run": stats.epochs_run,
        "ppo/skipped_steps": stats.skipped_steps,
    }
    if "value_loss" in stats.values:  # a critic trained
        metrics["loss/value_avg"] = dist.mean_of(stats.mean("value_loss"))
        metrics["val/clipfrac_avg"] = dist.mean_of(stats.mean("value_clipfrac"))
    if "kl_loss" in stats.values:  # ppo.kl_penalty loss: the k3 term before kl_coef
        metrics["loss/kl_avg"] = dist.mean_of(stats.mean("kl_loss"))
    if stats.grad_norms:
        metrics["policy/grad_norm"] = sum(stats.grad_norms) / len(stats.grad_norms)
    return metrics


# --- the loop ------------------------------------------------------------------------------------


@dataclass
class TrainState:
    """Everything the loop carries from one update to the next (and what a checkpoint saves)."""

    recipe: Recipe
    engine: Engine
    dist: Distributed
    model: torch.nn.Module  # PolicyAndValue, wrapped by accelerate (DDP/DeepSpeed/FSDP) with several processes
    sampler: PromptSampler
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    kl_controller: object
    step: int = 0  # updates completed
    episodes: int = 0
    consecutive_skips: int = 0
    last_skip_reason: str | None = None
    sizes: ModelSizes | None = None  # parameter counts for perf/mfu_* (counted before FSDP shards them)
    memory_peaks: dict[str, float] = field(default_factory=dict)  # CUDA: "rollout"/"update" -> most GB this run


def init_state(engine: Engine, prompts: list[str], dist: Distributed | None = None) -> TrainState:
    recipe = engine.recipe
    dist = dist or Distributed(recipe.train.device, engine.mixed_precision)
    if dist.mixed_precision != engine.mixed_precision:
        raise ValueError(f"the engine computes in {engine.mixed_precision!r} but the accelerator in "
                         f"{dist.mixed_precision!r}: load the engine with the Distributed's mixed_precision")
    configure_deepspeed(dist.accelerator, recipe.ppo.micro_batch_size, recipe.optim.max_grad_norm)
    if dist.world_size == 1 and not dist.uses_deepspeed:
        engine.store_frozen_weights_in_compute_dtype()
    sizes = engine.model_sizes()
    model, optimizer = dist.prepare(PolicyAndValue(engine.actor_critic), make_optimizer(engine, recipe.optim),
                                    cpu_malloc_tuning=engine.options.cpu_malloc_tuning)
    return TrainState(
        recipe=recipe,
        engine=engine,
        dist=dist,
        model=model,
        sampler=PromptSampler(prompts, seed=recipe.seed, shuffle=recipe.data.shuffle),
        optimizer=optimizer,
        scheduler=make_scheduler(optimizer, recipe.optim, recipe.train.total_updates),
        kl_controller=make_kl_controller(recipe.ppo),
        sizes=sizes,
    )


def process_prompts(sampler: PromptSampler, size: int, rank: int, world_size: int, group_size: int) -> list:
    """This process's episodes' prompts: every process draws the same global batch of ``size`` x
    ``world_size`` prompts and keeps its own slice (no prompt is seen twice), then repeats each prompt
    ``group_size`` times in a row, so a prompt's group is whole on one process: [p0 x G, p1 x G, ...]."""
    prompts = sampler.next_batch(size * world_size)[rank * size : (rank + 1) * size]
    return [prompt for prompt in prompts for _ in range(group_size)]


def train_step(state: TrainState) -> tuple[dict[str, float], Rollout]:
    """One PPO update: rollout -> advantages -> optimise -> adapt. Returns its metrics."""
    recipe, engine = state.recipe, state.engine
    started, cpu_started = time.perf_counter(), time.process_time()

    dist, G = state.dist, recipe.generation.num_generations
    enter_phase("rollout")
    prompts = process_prompts(state.sampler, recipe.ppo.rollout_batch_size, dist.rank, dist.world_size, G)
    deferred = defer_old_logprobs(recipe.ppo, engine, len(prompts))
    peaks: dict[str, float] = {}  # CUDA only: the GB each phase held at most, to set against `ppo plan`
    with (memory_phase("sampling and scoring the rollout"), phase_peak(dist.device, peaks, "rollout"),
          dist.rollout_parameters(state.model, recipe.train.fsdp_rollout)):
        rollout = engine.collect_rollout(prompts, old_logprobs=not deferred)
    rollout_seconds = time.perf_counter() - started
    rollout = check_rewards(rollout, state, G)

    kl_coef = state.kl_controller.value
    adv = compute_advantages(rollout, kl_coef, recipe.ppo, dist.reduce_sum if dist.world_size > 1 else None, G)

    skip_reason = find_non_finite(rollout, adv)
    if dist.any(skip_reason is not None):  # every process must skip together
        skip_reason = skip_reason or "non-finite numbers on another process"
    enter_phase("update")
    with memory_phase("updating the policy and critic"), phase_peak(dist.device, peaks, "update"):
        stats = optimise(state, rollout, adv) if skip_reason is None else None
    if stats is not None and stats.optimizer_steps == 0:
        skip_reason = "non-finite loss or gradients"
    if deferred:  # the metrics and the KL controller read the old log-probs; the advantages are unchanged
        if stats is None:  # the update was skipped before its first forward
            with dist.rollout_parameters(state.model, recipe.train.fsdp_rollout):
                old_logprobs = engine.evaluate_logprobs_and_values(rollout.generation, recipe.ppo.micro_batch_size)[0]
        else:
            old_logprobs = stats.old_logprobs
        rollout = rollout._replace(logprobs=old_logprobs)
        adv = compute_advantages(rollout, kl_coef, recipe.ppo, dist.reduce_sum if dist.world_size > 1 else None, G)

    metrics = rollout_metrics(rollout, adv, kl_coef, dist, G, critic_trains=engine.actor_critic.critic.trains)
    if stats is not None:
        metrics.update(update_metrics(stats, dist))
    metrics["skipped"] = int(skip_reason is not None)
    if skip_reason is None:
        state.consecutive_skips, state.last_skip_reason = 0, None
        state.kl_controller.update(metrics["objective/kl"], len(prompts) * dist.world_size)
    else:
        metrics["skip_reason"] = skip_reason
        state.consecutive_skips, state.last_skip_reason = state.consecutive_skips + 1, skip_reason
    metrics["lr"] = state.optimizer.param_groups[0]["lr"]
    if state.engine.actor_critic.critic.trains:
        metrics["value_lr"] = state.optimizer.param_groups[1]["lr"]
    state.scheduler.step()
    state.step += 1
    state.episodes += len(prompts)

    seconds = time.perf_counter() - started
    generated_tokens = float(rollout.generation.response_mask.sum())
    metrics.update({
        "step": state.step,
        "episode": state.episodes * dist.world_size,
        "time/rollout_s": rollout_seconds,
        "time/update_s": seconds - rollout_seconds,
        "time/step_s": seconds,
        # this process's CPU seconds, all threads: the speed figure on a shared machine, where wall time waits
        "time/step_cpu_s": time.process_time() - cpu_started,
        "tokens_per_s": generated_tokens / seconds,
        **perf_metrics(state, rollout.generation, rollout_seconds, seconds - rollout_seconds),
        **{f"memory/{phase}_peak_gb": gb for phase, gb in peaks.items()},
    })
    for phase, gb in peaks.items():
        state.memory_peaks[phase] = max(state.memory_peaks.get(phase, 0.0), gb)
    return metrics, rollout


def defer_old_logprobs(ppo: PPOConfig, engine: Engine, episodes: int) -> bool:
    """Leave the old log-probs out of the rollout, for the update's first epoch to compute?

    Exact where nothing reads them before the update and the policy cannot move before each episode's
    first forward in it: no critic (a value head's values come from the same forward), the KL in the
    loss (then the advantages do not read the KL; TRL's GRPO also skips this forward, where it runs
    one optimizer step per generation), and one mini-batch per epoch (the first optimizer step comes
    after every episode has been through the model). Saves one policy forward per update, and the
    first ratio is exactly 1.
    """
    ac = engine.actor_critic
    return (not ac.critic.trains and not ac.reference_is_policy and ppo.kl_in_loss
            and ppo.mini_batch_size >= episodes)


def check_rewards(rollout: Rollout, state: TrainState, group_size: int) -> Rollout:
    """Stop when no episode of the update has a reward (on any process): nothing to learn from, and
    the server or judge that failed is named. Critic-free estimators compare a completion with its
    group, so a group with one episode unscored leaves the update whole."""
    from ppo_cli.errors import RewardServerError

    if rollout.scored is None:
        return rollout
    scored = rollout.scored
    if state.recipe.ppo.critic_free and group_size > 1:
        scored = scored.view(-1, group_size).all(dim=1).repeat_interleave(group_size)
    if state.dist.any(bool(scored.any())):
        return rollout._replace(scored=scored)
    failures = [f for part in state.dist.gather_objects(rollout.reward_failures or {}) for f in part.values() if f]
    raise RewardServerError(
        f"update {state.step + 1}: no completion got a reward: {failures[0] if failures else 'every group had a failure'}",
        hint="the checkpoints written so far are intact; once the reward answers again, continue with "
             "ppo train RECIPE --resume",
    )


def perf_metrics(state: TrainState, generation, rollout_seconds: float, update_seconds: float) -> dict[str, float]:
    """perf/mfu_rollout and perf/mfu_update (against the probe's measured matmul peak; only where the
    probe ran, on CPU) and perf/decode_gbps (the policy's weights read per decode step / generation time)."""
    sizes, engine = state.sizes, state.engine
    if sizes is None:
        return {}
    out = {}
    if engine.generation_seconds > 0:
        out["perf/decode_gbps"] = decode_gbps(sizes.policy_bytes, generation.response_ids.shape[1], engine.generation_seconds)
    probe = state.dist.precision.probe
    if probe is not None:
        weights = next(engine.actor_critic.policy.parameters()).dtype
        half = state.dist.mixed_precision != "no" or weights in (torch.bfloat16, torch.float16)
        peak = probe.peak_flops("bf16" if half else "no")
        sequence_tokens = generation.sequences.numel()
        prompt_tokens, generated = int(generation.prompt_mask.sum()), int(generation.response_mask.sum())
        out["perf/mfu_rollout"] = mfu(rollout_flops(sizes, prompt_tokens, generated, sequence_tokens), rollout_seconds, peak)
        out["perf/mfu_update"] = mfu(update_flops(sizes, sequence_tokens, state.recipe.ppo.ppo_epochs), update_seconds, peak)
    return out


# What usually makes PPO numbers blow up, and the fix.
LIKELY_CAUSES = {
    "non-finite rewards": "the reward returned NaN or inf: check the reward function or model on these "
    "responses (empty responses are a common trigger)",
    "non-finite values": "the value head is diverging: lower optim.value_lr or ppo.vf_coef, keep "
    "ppo.cliprange_value small, or set ppo.whiten_rewards: true",
    "non-finite log-probs": "the policy's logits overflowed: the learning rate is too high (lower optim.lr) "
    "or float16 overflowed (use bfloat16)",
    "non-finite advantages": "rewards or values are exploding: set ppo.whiten_rewards: true and check the reward scale",
    "non-finite loss or gradients": "the learning rate is too high or the KL penalty too small: lower optim.lr, "
    "set optim.max_grad_norm, raise ppo.kl_coef",
    "non-finite numbers on another process": "another process saw NaN or inf in its rollout: see its metrics; "
    "usually the reward or the value head",
}


def find_non_finite(rollout: Rollout, adv: Advantages) -> str | None:
    """The first non-finite quantity of a rollout, by name, or None when all are finite."""
    mask = rollout.generation.response_mask
    values = rollout.values[mask]
    logprobs = [rollout.ref_logprobs[mask]] + ([] if rollout.logprobs is None else [rollout.logprobs[mask]])
    checks = (
        ("non-finite rewards", rollout.scores),
        ("non-finite values", values),
        ("non-finite log-probs", torch.cat(logprobs)),
        ("non-finite advantages", adv.advantages[mask]),
    )
    for reason, tensor in checks:
        if not torch.isfinite(tensor).all():
            return reason
    return None


def train(state: TrainState) -> Iterator[tuple[dict[str, float], Rollout]]:
    """Updates until total_updates; stops with a diagnostic after too many skipped updates in a row."""
    from ppo_cli.errors import TrainingError

    limit = state.recipe.train.max_consecutive_skips
    while state.step < state.recipe.train.total_updates:
        yield train_step(state)
        if state.consecutive_skips >= limit:
            raise TrainingError(
                f"stopped at update {state.step}: {state.consecutive_skips} updates in a row skipped for "
                f"{state.last_skip_reason}",
                hint=f"likely cause: {LIKELY_CAUSES[state.last_skip_reason]}; the last checkpoint is intact",
            )
