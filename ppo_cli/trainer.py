"""The PPO loop, in the order of the algorithm (cleanrl's ppo.py is the model):

    for each update:
        rollout    sample prompts, generate, old/ref log-probs, old values, scores
        advantages per-token rewards = score on the last token - beta * KL; GAE; whiten
        optimise   ppo_epochs x shuffled minibatches x micro-batches (grad accumulation):
                   clipped surrogate + vf_coef * clipped value loss - entropy_coef * entropy
        adapt      KL controller, LR schedule; log metrics
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ppo_cli.algo.advantages import compute_gae, shape_rewards
from ppo_cli.algo.kl import AdaptiveKLController, FixedKLController, kl_penalty
from ppo_cli.algo.losses import clipped_policy_loss, clipped_value_loss, entropy_from_logits, explained_variance
from ppo_cli.algo.masking import masked_mean, masked_whiten
from ppo_cli.engine.data import PromptSampler
from ppo_cli.engine.logprobs import policy_forward, selective_log_softmax, value_forward
from ppo_cli.engine.session import Engine
from ppo_cli.recipe import OptimConfig, PPOConfig, Recipe
from ppo_cli.stats import distinct_n
from ppo_cli.types import Advantages, Rollout

# --- setup ---------------------------------------------------------------------------------------


def make_kl_controller(ppo: PPOConfig):
    if ppo.adaptive_kl is None:
        return FixedKLController(ppo.kl_coef)
    return AdaptiveKLController(ppo.kl_coef, ppo.adaptive_kl.target, ppo.adaptive_kl.horizon)


def make_optimizer(engine: Engine, optim: OptimConfig) -> torch.optim.Optimizer:
    ac = engine.actor_critic
    groups = [
        {"params": ac.policy_parameters(), "lr": optim.lr},
        {"params": ac.value_parameters(), "lr": optim.value_lr or optim.lr},
    ]
    fused_ok = engine.device.type == "cuda"
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


def compute_advantages(rollout: Rollout, kl_coef: float, ppo: PPOConfig) -> Advantages:
    mask = rollout.generation.response_mask
    kl = kl_penalty(rollout.logprobs, rollout.ref_logprobs, ppo.kl_estimator).masked_fill(~mask, 0.0)
    rewards, non_score_rewards = shape_rewards(rollout.scores, kl, kl_coef, mask)
    if ppo.whiten_rewards:
        rewards = masked_whiten(rewards, mask, keep_mean=True)
    advantages, returns = compute_gae(rewards, rollout.values, mask, ppo.gamma, ppo.gae_lambda)
    if ppo.whiten_advantages:
        advantages = masked_whiten(advantages, mask)
    return Advantages(rewards, non_score_rewards, kl, advantages, returns)


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

    def add(self, **stats: torch.Tensor) -> None:
        for name, value in stats.items():
            self.values.setdefault(name, []).append(float(value.detach()))

    def mean(self, name: str) -> float:
        return sum(self.values[name]) / len(self.values[name])


def micro_batch_loss(engine: Engine, rollout: Rollout, adv: Advantages, rows: torch.Tensor, stats: UpdateStats):
    """Loss on a few episodes, trimmed to their longest response (padding costs no compute)."""
    ppo, ac, gen = engine.recipe.ppo, engine.actor_critic, rollout.generation
    T = max(1, int(gen.response_mask[rows].sum(dim=1).max()))
    response_ids, mask = gen.response_ids[rows, :T], gen.response_mask[rows, :T]
    sequences = torch.cat([gen.prompt_ids[rows], response_ids], dim=1)
    attention_mask = torch.cat([gen.prompt_mask[rows], mask], dim=1)

    logits, values = policy_forward(ac, sequences, attention_mask, T, engine.recipe.generation.temperature)
    logprobs = selective_log_softmax(logits, response_ids)
    if values is None:
        values = value_forward(ac, sequences, attention_mask, T)
    policy = clipped_policy_loss(logprobs, rollout.logprobs[rows, :T], adv.advantages[rows, :T], mask, ppo.cliprange)
    value = clipped_value_loss(values, rollout.values[rows, :T], adv.returns[rows, :T], mask, ppo.cliprange_value)
    with torch.set_grad_enabled(ppo.entropy_coef > 0):
        entropy = masked_mean(entropy_from_logits(logits), mask)
    loss = policy.loss + ppo.vf_coef * value.loss - ppo.entropy_coef * entropy
    stats.add(
        policy_loss=policy.loss, value_loss=value.loss, approx_kl=policy.approx_kl, clipfrac=policy.clipfrac,
        ratio=policy.ratio_mean, value_clipfrac=value.clipfrac, entropy=entropy,
    )
    return loss


def optimise(engine: Engine, optimizer, rollout: Rollout, adv: Advantages) -> UpdateStats:
    ppo, max_grad_norm = engine.recipe.ppo, engine.recipe.optim.max_grad_norm
    params = [p for group in optimizer.param_groups for p in group["params"]]
    batch_size, stats = len(rollout.prompts), UpdateStats(micro_batches_per_step=ppo.grad_accum_steps)
    for epoch in range(ppo.ppo_epochs):
        epoch_start = len(stats.values.get("approx_kl", []))
        order = torch.randperm(batch_size, device=engine.device)
        for mini_batch in order.split(ppo.mini_batch_size):
            optimizer.zero_grad(set_to_none=True)
            losses = []
            for rows in mini_batch.split(ppo.micro_batch_size):
                loss = micro_batch_loss(engine, rollout, adv, rows, stats)
                (loss / ppo.grad_accum_steps).backward()
                losses.append(loss.detach())
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm or float("inf"))
            # One NaN step would poison the weights for good: drop the step instead.
            if not (torch.isfinite(torch.stack(losses)).all() and torch.isfinite(grad_norm)):
                stats.skipped_steps += 1
                optimizer.zero_grad(set_to_none=True)
                continue
            stats.grad_norms.append(float(grad_norm))
            optimizer.step()
            stats.optimizer_steps += 1
        stats.epochs_run = epoch + 1
        epoch_kl = stats.values["approx_kl"][epoch_start:]
        # seed 003: stop reusing this batch once the policy has moved too far from the rollout policy.
        if ppo.max_kl is not None and sum(epoch_kl) / len(epoch_kl) > ppo.max_kl:
            break
    optimizer.zero_grad(set_to_none=True)
    return stats


# --- metrics -------------------------------------------------------------------------------------


def rollout_metrics(rollout: Rollout, adv: Advantages, kl_coef: float) -> dict[str, float]:
    """TRL's objective/* names: sums over response tokens, means over episodes."""
    mask = rollout.generation.response_mask
    kl_sum = adv.kl.sum(dim=1)
    non_score = adv.non_score_rewards.sum(dim=1)
    metrics = {
        "objective/kl": kl_sum.mean().item(),
        "objective/entropy": (-rollout.logprobs * mask).sum(dim=1).mean().item(),
        "objective/non_score_reward": non_score.mean().item(),
        "objective/rlhf_reward": (non_score + rollout.scores).mean().item(),
        "objective/scores": rollout.scores.mean().item(),
        "objective/scores_std": rollout.scores.std().item() if len(rollout.scores) > 1 else 0.0,
        "objective/kl_coef": kl_coef,
        "val/explained_variance": float(explained_variance(rollout.values, adv.returns, mask)),
        "val/mean": masked_mean(rollout.values, mask).item(),
        "eos_rate": rollout.generation.finished.float().mean().item(),
        "response_length": mask.sum(dim=1).float().mean().item(),
        "samples/distinct_1": distinct_n(rollout.responses, 1),
        "samples/distinct_2": distinct_n(rollout.responses, 2),
    }
    for name, values in rollout.score_components.items():
        metrics[f"reward/{name}"] = sum(values) / len(values)
    return metrics


def update_metrics(stats: UpdateStats) -> dict[str, float]:
    metrics = {
        "policy/approxkl_avg": stats.mean("approx_kl"),
        "policy/clipfrac_avg": stats.mean("clipfrac"),
        "policy/entropy_avg": stats.mean("entropy"),
        "loss/policy_avg": stats.mean("policy_loss"),
        "loss/value_avg": stats.mean("value_loss"),
        "val/clipfrac_avg": stats.mean("value_clipfrac"),
        "val/ratio": stats.mean("ratio"),
        # Before the first optimizer step the policy is the rollout policy, so this is 1 up to numerics;
        # far from 1 means rollout and update compute log-probs differently (seed 001: temperature).
        "val/ratio_first_minibatch": sum(stats.values["ratio"][: stats.micro_batches_per_step]) / stats.micro_batches_per_step,
        "ppo/epochs_run": stats.epochs_run,
        "ppo/skipped_steps": stats.skipped_steps,
    }
    if stats.grad_norms:
        metrics["policy/grad_norm"] = sum(stats.grad_norms) / len(stats.grad_norms)
    return metrics


# --- the loop ------------------------------------------------------------------------------------


@dataclass
class TrainState:
    """Everything the loop carries from one update to the next (and what a checkpoint saves)."""

    recipe: Recipe
    engine: Engine
    sampler: PromptSampler
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    kl_controller: object
    step: int = 0  # updates completed
    episodes: int = 0
    consecutive_skips: int = 0
    last_skip_reason: str | None = None


def init_state(engine: Engine, prompts: list[str]) -> TrainState:
    recipe = engine.recipe
    optimizer = make_optimizer(engine, recipe.optim)
    return TrainState(
        recipe=recipe,
        engine=engine,
        sampler=PromptSampler(prompts, seed=recipe.seed, shuffle=recipe.data.shuffle),
        optimizer=optimizer,
        scheduler=make_scheduler(optimizer, recipe.optim, recipe.train.total_updates),
        kl_controller=make_kl_controller(recipe.ppo),
    )


def train_step(state: TrainState) -> tuple[dict[str, float], Rollout]:
    """One PPO update: rollout -> advantages -> optimise -> adapt. Returns its metrics."""
    recipe, engine = state.recipe, state.engine
    started = time.perf_counter()

    prompts = state.sampler.next_batch(recipe.ppo.rollout_batch_size)
    rollout = engine.collect_rollout(prompts)
    rollout_seconds = time.perf_counter() - started

    kl_coef = state.kl_controller.value
    adv = compute_advantages(rollout, kl_coef, recipe.ppo)

    skip_reason = find_non_finite(rollout, adv)
    stats = optimise(engine, state.optimizer, rollout, adv) if skip_reason is None else None
    if stats is not None and stats.optimizer_steps == 0:
        skip_reason = "non-finite loss or gradients"

    metrics = rollout_metrics(rollout, adv, kl_coef)
    if stats is not None:
        metrics.update(update_metrics(stats))
    metrics["skipped"] = int(skip_reason is not None)
    if skip_reason is None:
        state.consecutive_skips, state.last_skip_reason = 0, None
        state.kl_controller.update(metrics["objective/kl"], len(prompts))
    else:
        metrics["skip_reason"] = skip_reason
        state.consecutive_skips, state.last_skip_reason = state.consecutive_skips + 1, skip_reason
    metrics["lr"] = state.optimizer.param_groups[0]["lr"]
    state.scheduler.step()
    state.step += 1
    state.episodes += len(prompts)

    seconds = time.perf_counter() - started
    generated_tokens = float(rollout.generation.response_mask.sum())
    metrics.update({
        "step": state.step,
        "episode": state.episodes,
        "time/rollout_s": rollout_seconds,
        "time/update_s": seconds - rollout_seconds,
        "time/step_s": seconds,
        "tokens_per_s": generated_tokens / seconds,
    })
    return metrics, rollout


# seed 001, "The knobs that break runs": what usually makes PPO numbers blow up, and the fix.
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
}


def find_non_finite(rollout: Rollout, adv: Advantages) -> str | None:
    """The first non-finite quantity of a rollout, by name, or None when all are finite."""
    mask = rollout.generation.response_mask
    checks = (
        ("non-finite rewards", rollout.scores),
        ("non-finite values", rollout.values[mask]),
        ("non-finite log-probs", torch.cat([rollout.logprobs[mask], rollout.ref_logprobs[mask]])),
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
