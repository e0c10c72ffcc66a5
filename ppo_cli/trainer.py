"""The PPO loop, in the order of the algorithm (cleanrl's ppo.py is the model):

    for each update:
        rollout    sample prompts, generate, old/ref log-probs, old values, scores
        advantages per-token rewards = score on the last token - beta * KL; GAE; whiten
                   (critic-free: per group of a prompt's completions, GRPO / RLOO / REINFORCE++)
        optimise   ppo_epochs x shuffled minibatches x micro-batches (grad accumulation):
                   clipped surrogate + vf_coef * clipped value loss - entropy_coef * entropy
                   (critic-free: no value term; GRPO's + beta * k3 KL with ppo.kl_penalty loss)
        adapt      KL controller, LR schedule; log metrics

The loop comes first (train, train_step), then each phase's functions in that order. Around it:
train_setup.py builds the state the loop carries (optimizer, schedule, KL controller), train_metrics.py
turns each phase into metrics, train_checks.py decides when an update is skipped or the run stops.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, NamedTuple

import torch

from ppo_cli import metric_names as names
from ppo_cli.algo.aggregation import aggregate_loss
from ppo_cli.algo.estimators import ESTIMATORS, EstimatorSettings
from ppo_cli.algo.group import informative_groups
from ppo_cli.algo.importance import truncated_is_weights
from ppo_cli.algo.kl import kl_penalty
from ppo_cli.algo.losses import clipped_policy_loss, clipped_value_loss
from ppo_cli.algo.masking import mask_truncated_completions, masked_mean
from ppo_cli.algo.token_selection import high_entropy_mask
from ppo_cli.collectives import enter as enter_phase
from ppo_cli.distributed import mark_accumulation_boundary
from ppo_cli.engine.data import PromptSampler
from ppo_cli.engine.envs.metrics import episode_metrics
from ppo_cli.engine.engine import Engine
from ppo_cli.engine.malloc import release_freed_memory, run_objects_frozen
from ppo_cli.engine.shared_prompts import prompt_groups
from ppo_cli.memory_peaks import phase_peak
from ppo_cli.resource_errors import phase as memory_phase
from ppo_cli.recipe import PPOConfig
from ppo_cli.train_checks import LIKELY_CAUSES, check_rewards, find_non_finite
from ppo_cli.train_metrics import (
    ScoredEpisodes,
    UpdateStats,
    generated_reward_metrics,
    perf_metrics,
    rollout_metrics,
    update_metrics,
)
from ppo_cli.train_setup import TrainState
from ppo_cli.rollout_rows import concat_components, concat_rollouts, concat_scored, merge_failures, select_rows
from ppo_cli.types import Advantages, DeferredOldLogprobs, Rollout

# --- the loop ------------------------------------------------------------------------------------


def train(state: TrainState) -> Iterator[tuple[dict[str, float], Rollout]]:
    """Updates until total_updates; stops with a diagnostic after too many skipped updates in a row."""
    from ppo_cli.errors import RESUME, TrainingError

    limit = state.recipe.train.max_consecutive_skips
    with run_objects_frozen():  # each update's garbage collection walks what the update made, not the models
        while state.step < state.recipe.train.total_updates:
            yield train_step(state)
            if state.consecutive_skips >= limit:
                raise TrainingError(
                    f"stopped at update {state.step}: {state.consecutive_skips} updates in a row skipped for "
                    f"{state.last_skip_reason}",
                    # Resuming unchanged would meet the same numbers: the fix is a setting, which --force accepts.
                    hint=f"likely cause: {LIKELY_CAUSES[state.last_skip_reason]}; the last checkpoint is intact: "
                         f"change the setting, then continue from it with {RESUME} --force (which accepts the changed recipe)",
                )


def release_update_memory(engine: Engine) -> None:
    """CPU with the heap tuning on: hand the heap's free pages back to the kernel once, after the update.

    The tuning (engine/malloc.keep_freed_memory) keeps freed blocks so that the update's micro-batches
    reuse them; kept past the update, the next rollout's and update's different mix of block sizes
    piles up beside them and the resident set grows from update to update (docs/memory.md, "The glibc
    heap tuning"). Once per update, the price is one fault-in of the next update's pages."""
    if engine.device.type == "cpu" and engine.options.cpu_malloc_tuning:
        release_freed_memory()


def train_step(state: TrainState) -> tuple[dict[str, float], Rollout]:
    """One PPO update: rollout -> advantages -> optimise -> adapt. Returns its metrics."""
    recipe, engine = state.recipe, state.engine
    started, cpu_started = time.perf_counter(), time.process_time()

    dist, G = state.dist, recipe.generation.num_generations
    enter_phase("rollout")
    deferred = defer_old_logprobs(recipe.ppo, engine, recipe.episodes_per_update)
    peaks: dict[str, float] = {}  # CUDA only: the GB each phase held at most, to set against `ppo plan`
    filtered = None
    with (memory_phase("sampling and scoring the rollout"), phase_peak(dist.device, peaks, "rollout"),
          dist.rollout_parameters(state.model, recipe.train.fsdp_rollout)):
        if recipe.ppo.filter_groups:
            rollout, filtered = collect_filtered_rollout(state, deferred)
        else:
            prompts = process_prompts(state.sampler, recipe.ppo.rollout_batch_size, dist.rank, dist.world_size, G)
            rollout = engine.collect_rollout(prompts, old_logprobs=not deferred)
    rollout_seconds = time.perf_counter() - started
    if filtered is None:  # collect_filtered_rollout checks each round's
        rollout = check_rewards(rollout, state, G)
    prompts = rollout.prompts  # the episodes trained on

    kl_coef = state.kl_controller.value
    adv = compute_advantages(rollout, kl_coef, recipe.ppo, dist.reduce_sum if dist.world_size > 1 else None, G)

    skip_reason = find_non_finite(rollout, adv)
    if dist.any(skip_reason is not None):  # every process must skip together
        skip_reason = skip_reason or "non-finite numbers on another process"
    enter_phase("update")
    with memory_phase("updating the policy and critic"), phase_peak(dist.device, peaks, "update"):
        stats = optimise(state, rollout, adv) if skip_reason is None else None
    release_update_memory(engine)
    if stats is not None and stats.optimizer_steps == 0:
        skip_reason = "non-finite loss or gradients"
    if deferred:  # the metrics and the KL controller read the old log-probs; the advantages are unchanged
        rollout = fill_in_old_logprobs(state, rollout)
        adv = compute_advantages(rollout, kl_coef, recipe.ppo, dist.reduce_sum if dist.world_size > 1 else None, G)

    metrics = rollout_metrics(rollout, adv, kl_coef, dist, G, critic_trains=engine.actor_critic.critic.trains)
    if not recipe.ppo.uses_reference:  # no reference forward ran: the KL was not measured (not 0, which kl_zero reads)
        metrics[names.OBJECTIVE_KL] = float("nan")
    if filtered is not None:  # the reward metrics count the dropped groups too
        metrics.update(generated_reward_metrics(filtered.generated, metrics[names.OBJECTIVE_NON_SCORE_REWARD], dist, G))
        metrics.update(filtered.metrics)
    if rollout.episodes is not None:  # episodes of several turns (one process: check_environment)
        metrics.update(episode_metrics(rollout.episodes))
    if stats is not None:
        metrics.update(update_metrics(stats, dist))
    metrics[names.SKIPPED] = int(skip_reason is not None)
    if skip_reason is None:
        state.consecutive_skips, state.last_skip_reason = 0, None
        state.kl_controller.update(metrics[names.OBJECTIVE_KL], len(prompts) * dist.world_size)
    else:
        metrics[names.SKIP_REASON] = skip_reason
        state.consecutive_skips, state.last_skip_reason = state.consecutive_skips + 1, skip_reason
    metrics[names.LR] = state.optimizer.param_groups[0]["lr"]
    if state.engine.actor_critic.critic.trains:
        metrics[names.VALUE_LR] = state.optimizer.param_groups[1]["lr"]
    state.scheduler.step()
    state.step += 1
    state.episodes += len(prompts)

    seconds = time.perf_counter() - started
    generated_tokens = float(rollout.generation.action_mask.sum()) if filtered is None else filtered.generated_tokens
    metrics.update({
        names.STEP: state.step,
        names.EPISODE: state.episodes * dist.world_size,
        names.TIME_ROLLOUT_S: rollout_seconds,
        names.TIME_UPDATE_S: seconds - rollout_seconds,
        names.TIME_STEP_S: seconds,
        # this process's CPU seconds, all threads: the speed figure on a shared machine, where wall time waits
        names.TIME_STEP_CPU_S: time.process_time() - cpu_started,
        names.TOKENS_PER_S: generated_tokens / seconds,
        **perf_metrics(state, rollout.generation, rollout_seconds, seconds - rollout_seconds),
        **{names.memory_peak_gb(phase): gb for phase, gb in peaks.items()},
    })
    for phase, gb in peaks.items():
        state.memory_peaks[phase] = max(state.memory_peaks.get(phase, 0.0), gb)
    return metrics, rollout


# --- phase 1: rollout ----------------------------------------------------------------------------


def process_prompts(sampler: PromptSampler, size: int, rank: int, world_size: int, group_size: int) -> list:
    """This process's episodes' prompts: every process draws the same global batch of ``size`` x
    ``world_size`` prompts and keeps its own slice (no prompt is seen twice), then repeats each prompt
    ``group_size`` times in a row, so a prompt's group is whole on one process: [p0 x G, p1 x G, ...]."""
    prompts = sampler.next_batch(size * world_size)[rank * size : (rank + 1) * size]
    return [prompt for prompt in prompts for _ in range(group_size)]


class FilteredRollout(NamedTuple):
    """What collect_filtered_rollout sampled besides the rollout it keeps."""

    generated: ScoredEpisodes  # every episode of every round on this process, the dropped groups' too
    generated_tokens: float  # the policy's tokens sampled in every round, this process
    metrics: dict[str, float]  # filter/*: kept groups, rounds, generated episodes, fill


def collect_filtered_rollout(state: TrainState, deferred: bool) -> tuple[Rollout, FilteredRollout]:
    """ppo.filter_groups (DAPO's dynamic sampling): rounds of ``rollout_batch_size`` prompts x G completions,
    each through engine.collect_rollout, keeping the groups whose completions scored apart
    (algo/group.py informative_groups), until every process holds ``rollout_batch_size`` of them or
    ``max_filter_rounds`` extra rounds have run.

    Every process runs the same rounds (the stop is decided on the gathered counts) and trains on the same
    number of groups, the fewest any process kept (the optimizer's collectives need equal mini-batches);
    groups stay whole on their process. When no process kept a group the last round is trained on as it
    came (its groups' advantages are 0: the update moves only through the KL term). The prompt sampler
    simply advances one batch per round, so a checkpoint taken after the update resumes exactly.
    """
    recipe, engine, dist, G = state.recipe, state.engine, state.dist, state.recipe.generation.num_generations
    target = recipe.ppo.rollout_batch_size
    kept, generated, tokens, kept_here = [], [], 0.0, 0
    for rounds in range(1, recipe.ppo.max_filter_rounds + 2):
        prompts = process_prompts(state.sampler, target, dist.rank, dist.world_size, G)
        rollout = check_rewards(engine.collect_rollout(prompts, old_logprobs=not deferred), state, G)
        generated.append(scored_episodes([rollout]))
        tokens += float(rollout.generation.action_mask.sum())
        groups = informative_groups(rollout.scores, G, rollout.scored).nonzero().flatten()[: target - kept_here]
        if len(groups):
            rows = (groups.unsqueeze(1) * G + torch.arange(G, device=groups.device)).flatten()
            kept.append(select_rows(rollout, rows))
            kept_here += len(groups)
        counts = dist.gather(torch.tensor([kept_here], device=dist.device))
        if int(counts.min()) >= target:
            break
    trained_groups = int(counts.min())
    if trained_groups > 0:  # else the last round, as it came
        rollout = concat_rollouts(kept, engine.pad_token_id)
        rollout = select_rows(rollout, torch.arange(trained_groups * G, device=rollout.scores.device))
    everything = scored_episodes(generated)
    metrics = {
        names.FILTER_KEPT_GROUPS: trained_groups * dist.world_size,
        names.FILTER_ROUNDS: rounds,
        names.FILTER_GENERATED_EPISODES: rounds * target * G * dist.world_size,
        names.FILTER_FILL: trained_groups / target,
    }
    return rollout, FilteredRollout(everything, tokens, metrics)


def scored_episodes(parts: list) -> ScoredEpisodes:
    """The reward part of rollouts (or of ScoredEpisodes), one after another: no per-token tensors kept."""
    return ScoredEpisodes(torch.cat([p.scores for p in parts]), concat_components(parts), concat_scored(parts),
                          merge_failures(parts))


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


def fill_in_old_logprobs(state: TrainState, rollout: Rollout) -> Rollout:
    """The rollout with its old log-probs as a tensor, where it left them to the update (DeferredOldLogprobs):
    those the update's first epoch recorded, or, when the update was skipped before its first forward, a
    forward of their own with the policy as it is (unchanged since the rollout). The one place that turns
    deferred old log-probs into log-probs; a rollout that has them comes back as it is."""
    deferred = rollout.logprobs
    if not isinstance(deferred, DeferredOldLogprobs):
        return rollout
    if deferred.complete:
        return rollout._replace(logprobs=deferred.logprobs)
    recipe = state.recipe
    with state.dist.rollout_parameters(state.model, recipe.train.fsdp_rollout):
        logprobs = state.engine.evaluate_logprobs_and_values(rollout.generation, recipe.ppo.micro_batch_size,
                                                             reference=False)[0]
    return rollout._replace(logprobs=logprobs)


# --- phase 2: advantages -------------------------------------------------------------------------


def compute_advantages(rollout: Rollout, kl_coef: float, ppo: PPOConfig, reduce_sum=None,
                       group_size: int = 1) -> Advantages:
    """The per-token KL to the reference, then ``ppo.advantage``'s estimator (algo/estimators.py) on the
    trained tokens. ``kl_coef`` weighs the KL in the reward (0 when ``ppo.kl_in_loss``: it is in the loss).
    ``reduce_sum`` sums across processes, so whitening uses the global batch's statistics.
    ``group_size``: completions per prompt, contiguous in the rollout (generation.num_generations).
    Episodes without a reward (rollout.scored False) take no part: their advantages are 0 and they
    count in no whitening statistic."""
    if isinstance(rollout.logprobs, DeferredOldLogprobs) or not ppo.uses_reference:
        # left to the update (the KL is in the loss, nothing here reads it), or no reference forward ran
        kl = torch.zeros_like(rollout.ref_logprobs)
    else:
        kl = kl_penalty(rollout.logprobs, rollout.ref_logprobs, ppo.kl_estimator).masked_fill(~rollout.generation.action_mask, 0.0)
    settings = EstimatorSettings(
        kl_coef=0.0 if ppo.kl_in_loss else kl_coef, gamma=ppo.gamma, lam=ppo.gae_lambda,
        whiten_rewards=ppo.whiten_rewards, whiten_advantages=ppo.whiten_advantages,
        scale_rewards=ppo.scale_rewards, group_size=group_size,
    )
    estimate = ESTIMATORS[ppo.advantage](rollout.scores, kl, rollout.values, rollout.train_mask, settings, reduce_sum)
    return Advantages(estimate.rewards, estimate.non_score_rewards, kl, estimate.advantages, estimate.returns)


# --- phase 3: optimise ---------------------------------------------------------------------------


def optimise(state: "TrainState", rollout: Rollout, adv: Advantages) -> UpdateStats:
    ppo, max_grad_norm, optimizer = state.recipe.ppo, state.recipe.optim.max_grad_norm, state.optimizer
    accelerator = state.dist.accelerator
    params = [p for group in optimizer.param_groups for p in group["params"]]
    batch_size, stats = len(rollout.prompts), UpdateStats()
    token_mean = ppo.loss_aggregation == "token_mean"
    loss_tokens = policy_loss_mask(rollout, ppo, slice(None)).sum(dim=1)  # (B,)
    if isinstance(rollout.logprobs, DeferredOldLogprobs) and ppo.mini_batch_size < batch_size:
        raise ValueError("old log-probs left to the update need one mini-batch per epoch (defer_old_logprobs)")
    for epoch in range(ppo.ppo_epochs):
        if epoch == 1:  # every episode has been through the first forward: deferred old log-probs are known
            rollout = fill_in_old_logprobs(state, rollout)
        epoch_start = len(stats.values.get("approx_kl", []))
        order = torch.randperm(batch_size, device=state.engine.device)
        for index_in_epoch, mini_batch in enumerate(order.split(ppo.mini_batch_size)):
            optimizer.zero_grad(set_to_none=True)
            micro_batches = split_micro_batches(mini_batch, rollout, ppo)
            if epoch == 0 and index_in_epoch == 0:
                stats.micro_batches_per_step = len(micro_batches)
            # token_mean: one mean over every loss token of the optimizer step, on every process (TRL's
            # "dapo" normalizer): the mean over processes of each one's count, as their gradients are averaged.
            step_tokens = state.dist.mean_of(float(loss_tokens[mini_batch].sum())) if token_mean else 0.0
            for index, rows in enumerate(micro_batches):
                # Gradients are averaged across processes once per mini-batch, not per micro-batch.
                sync = index == len(micro_batches) - 1
                mark_accumulation_boundary(accelerator, sync)
                with contextlib.nullcontext() if sync else accelerator.no_sync(state.model):
                    policy_loss, other_loss = micro_batch_loss(state, rollout, adv, rows, stats)
                    # Each micro-batch's terms are means over its own tokens or completions: weight them by
                    # its share of the mini-batch's (1 / grad_accum_steps when all are the same size).
                    episode_share = len(rows) / len(mini_batch)
                    policy_share = token_share(loss_tokens[rows], step_tokens) if token_mean else episode_share
                    accelerator.backward(policy_loss * policy_share + other_loss * episode_share)
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


def split_micro_batches(mini_batch: torch.Tensor, rollout: Rollout, ppo: PPOConfig) -> list[torch.Tensor]:
    if ppo.micro_batch_tokens is None:
        return list(prompts_together(mini_batch, rollout).split(ppo.micro_batch_size))
    gen = rollout.generation
    lengths = gen.response_mask[mini_batch].sum(dim=1)
    return token_budget_micro_batches(mini_batch, lengths, gen.prompt_ids.shape[1], ppo.micro_batch_tokens)


def prompts_together(mini_batch: torch.Tensor, rollout: Rollout) -> torch.Tensor:
    """The mini-batch's episode indices with the completions of each prompt next to each other, so that
    its micro-batches run each prompt once (engine/shared_prompts.py); unchanged where no prompt repeats.
    The optimizer step's gradient is the same sum over the same episodes, however they are cut."""
    gen = rollout.generation
    groups = prompt_groups(gen.prompt_ids[mini_batch], gen.prompt_mask[mini_batch], gen.prompt_ids.shape[1])
    if int(groups.max()) + 1 == len(mini_batch):
        return mini_batch
    return mini_batch[torch.sort(groups, stable=True).indices]


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


def token_share(micro_batch_tokens: torch.Tensor, step_tokens: float) -> float:
    """A micro-batch's share of the optimizer step's loss tokens (0 when the step has none): its token
    mean times this is its part of one token mean over the step."""
    return float(micro_batch_tokens.sum()) / step_tokens if step_tokens > 0 else 0.0


def policy_loss_mask(rollout: Rollout, ppo: PPOConfig, rows, T: int | None = None) -> torch.Tensor:
    """(M, T) bool: the tokens the policy loss averages over; episodes without a reward leave it, and
    with ppo.mask_truncated the completions cut by max_new_tokens too."""
    gen = rollout.generation
    mask = rollout.train_mask[rows, :T]
    return mask_truncated_completions(mask, gen.finished[rows]) if ppo.mask_truncated else mask


def micro_batch_loss(state: "TrainState", rollout: Rollout, adv: Advantages, rows: torch.Tensor, stats: UpdateStats):
    """Loss on a few episodes, trimmed to their longest response (padding costs no compute), in two
    parts that optimise weighs differently: (the policy loss with GRPO's KL term, aggregated as
    ppo.loss_aggregation; the value loss and entropy bonus, token means)."""
    ppo, gen = state.recipe.ppo, rollout.generation
    T = max(1, int(gen.response_mask[rows].sum(dim=1).max()))
    response_ids = gen.response_ids[rows, :T]
    sequences = torch.cat([gen.prompt_ids[rows], response_ids], dim=1)
    attention_mask = torch.cat([gen.prompt_mask[rows], gen.response_mask[rows, :T]], dim=1)
    mask = rollout.train_mask[rows, :T]  # episodes without a reward leave the loss

    fixed = rollout.fixed_value_features
    # The rollout's autocast, explicitly: accelerate autocasts a prepared model's forward under DDP but
    # not under FSDP2, whose update would then compute in float32 and the first ratio would not be 1.
    # Log-probs and entropies come a chunk of positions at a time (engine/logprobs.py): no (B, T, V) logits.
    with state.engine.autocast():
        logprobs, entropies, values = state.model(sequences, attention_mask, response_ids, state.recipe.generation.temperature,
                                                  None if fixed is None else fixed[rows, :T],
                                                  entropy="grad" if ppo.entropy_coef > 0 else "value")
    if isinstance(rollout.logprobs, DeferredOldLogprobs):  # the policy has not moved since the rollout: these are the old ones
        old_logprobs = rollout.logprobs.take(rows, logprobs, gen.action_mask[rows, :T])
    else:
        old_logprobs = rollout.logprobs[rows, :T]
    loss_mask = policy_loss_mask(rollout, ppo, rows, T)
    weights = None
    if ppo.rollout_is_clip is not None and rollout.sampler_logprobs is not None:  # a separate sampler drew them
        weights = truncated_is_weights(old_logprobs, rollout.sampler_logprobs[rows, :T], gen.action_mask[rows, :T],
                                       ppo.rollout_is_clip)
    token_entropy = entropies  # (M, T), with a gradient only under an entropy bonus
    if ppo.top_entropy_quantile < 1.0:  # train on the high-entropy tokens only (TRL's top_entropy_quantile)
        # Over every process's micro-batch, as TRL; not with micro_batch_tokens, whose micro-batch counts differ.
        dist = state.dist
        gather = dist.gather if dist.world_size > 1 and ppo.micro_batch_tokens is None else None
        weights = select_high_entropy_tokens(token_entropy, loss_mask, ppo.top_entropy_quantile, weights, stats, gather)
    max_len = state.recipe.generation.max_new_tokens
    policy = clipped_policy_loss(logprobs, old_logprobs, adv.advantages[rows, :T], loss_mask,
                                 ppo.cliprange, token_weights=weights, cliprange_high=ppo.cliprange_high,
                                 ratio_level=ppo.ratio_level, loss_agg_mode=ppo.loss_aggregation,
                                 max_response_length=max_len)
    with torch.set_grad_enabled(ppo.entropy_coef > 0):
        entropy = masked_mean(token_entropy, mask)
    other_loss = -ppo.entropy_coef * entropy
    if state.engine.actor_critic.critic.trains:  # value.kind none: its values are zeros, no value loss
        value = clipped_value_loss(values, rollout.values[rows, :T], adv.returns[rows, :T], mask, ppo.cliprange_value)
        other_loss = other_loss + ppo.vf_coef * value.loss
        stats.add(value_loss=value.loss, value_clipfrac=value.clipfrac)
    policy_loss = policy.loss
    if ppo.kl_in_loss and ppo.uses_reference:  # GRPO: beta * k3(policy || reference) per token, aggregated as the policy loss
        # Padding zeroed before the exp: exp(ref - logprob) of a padding token can overflow, and its
        # inf would reach the gradient as 0 * inf = NaN through a where() after it.
        ref_kl = kl_penalty(torch.where(loss_mask, logprobs, 0), torch.where(loss_mask, rollout.ref_logprobs[rows, :T], 0), "k3")
        kl_loss = aggregate_loss(ref_kl, loss_mask, ppo.loss_aggregation, max_len)
        policy_loss = policy_loss + state.kl_controller.value * kl_loss
        stats.add(kl_loss=kl_loss)
    stats.add(
        policy_loss=policy.loss, approx_kl=policy.approx_kl, clipfrac=policy.clipfrac, ratio=policy.ratio_mean,
        clipfrac_low=policy.clipfrac_low, clipfrac_high=policy.clipfrac_high, entropy=entropy,
    )
    return policy_loss, other_loss


def select_high_entropy_tokens(token_entropy: torch.Tensor, loss_mask: torch.Tensor, top_quantile: float,
                               weights: torch.Tensor | None, stats: UpdateStats, gather=None) -> torch.Tensor:
    """The policy loss's token weights (M, T) with the tokens below the micro-batch's entropy threshold zeroed
    (algo/token_selection.py); the threshold recorded for policy/entropy_threshold. ``gather``: with several
    processes, Distributed.gather, so that the threshold is taken over every process's micro-batch as TRL
    does; every process must then call this as many times (equal micro-batches)."""
    everywhere = (gather(token_entropy.detach()), gather(loss_mask)) if gather is not None else (None, None)
    selection = high_entropy_mask(token_entropy, loss_mask, top_quantile, *everywhere)
    stats.add(entropy_threshold=selection.threshold)
    keep = selection.keep.to(token_entropy.dtype)
    return keep if weights is None else weights * keep
