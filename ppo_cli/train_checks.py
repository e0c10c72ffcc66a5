"""When an update is skipped or the run stops: non-finite numbers in a rollout (and what usually
causes each), a rollout in which no episode got a reward."""

from __future__ import annotations

import torch

from ppo_cli.train_setup import TrainState
from ppo_cli.types import Advantages, Rollout


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
    mask = rollout.generation.action_mask
    values = rollout.values[mask]
    logprobs = [rollout.ref_logprobs[mask]] + ([rollout.logprobs[mask]] if isinstance(rollout.logprobs, torch.Tensor) else [])
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


def check_rewards(rollout: Rollout, state: TrainState, group_size: int) -> Rollout:
    """Stop when no episode of the update has a reward (on any process): nothing to learn from, and
    the server or judge that failed is named. Critic-free estimators compare a completion with its
    group, so a group with one episode unscored leaves the update whole."""
    if rollout.scored is None:
        return rollout
    scored = rollout.scored
    if state.recipe.ppo.critic_free and group_size > 1:
        scored = scored.view(-1, group_size).all(dim=1).repeat_interleave(group_size)
    if state.dist.any(bool(scored.any())):
        return rollout._replace(scored=scored)
    failures = [f for part in state.dist.gather_objects(rollout.reward_failures or {}) for f in part.values() if f]
    raise no_reward_error(state.step + 1, failures, rollout.episodes)


def no_reward_error(update: int, failures: list[str], episodes=None):
    """The line that stops a run whose update has no reward: the reward's failure, or, when every episode's
    environment failed (episodes of several turns, run in one process), the environment's: the fix is there.
    In update 1 nothing is kept (train.py discards a run stopped before its first update): start again."""
    from ppo_cli.errors import RESUME, RewardServerError

    then = ("run the same ppo train again (the run stopped in its first update, so nothing was kept)" if update == 1
            else f"continue with {RESUME} (the checkpoints written so far are intact)")
    if episodes and all(e.failed for e in episodes):
        first = next((e.failure for e in episodes if e.failure), "no failure line")
        return RewardServerError(f"update {update}: every episode's environment failed: {first}",
                                 hint=f"fix the environment (ppo rollout writes each episode's env_failure), then {then}")
    return RewardServerError(
        f"update {update}: no completion got a reward: {failures[0] if failures else 'every group had a failure'}",
        hint=(f"the checkpoints written so far are intact; once the reward answers again, continue with {RESUME}"
              if update > 1 else f"once the reward answers, {then}"),
    )
