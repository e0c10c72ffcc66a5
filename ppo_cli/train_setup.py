"""What the PPO loop carries from one update to the next (TrainState), and how it is built: the
optimizer (policy and critic parameter groups), the learning-rate schedule, the KL controller."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ppo_cli.algo.kl import AdaptiveKLController, FixedKLController
from ppo_cli.distributed import Distributed, configure_deepspeed
from ppo_cli.engine.actor_critic import PolicyAndValue
from ppo_cli.engine.data import PromptSampler
from ppo_cli.engine.engine import Engine
from ppo_cli.perf import ModelSizes
from ppo_cli.recipe import OptimConfig, PPOConfig, Recipe


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
    dist.shard_reward_models(engine.reward, engine.actor_critic)  # FSDP: the frozen reward models too
    dist.keep_value_head_in_float32(engine.actor_critic)  # FSDP gathering in bf16/fp16
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


def make_kl_controller(ppo: PPOConfig):
    if ppo.adaptive_kl is None:
        return FixedKLController(ppo.kl_coef)
    return AdaptiveKLController(ppo.kl_coef, ppo.adaptive_kl.target, ppo.adaptive_kl.horizon)
