"""The names of the training metrics: one line of metrics.jsonl per update, written by the trainer
(trainer.py, train_metrics.py) and observe.py, read by the health monitor, the progress line (report.py),
the learning curves (plots.py), the trackers and a resumed run. Users' dashboards read these names, so
none of them may change; each constant is its name upper-cased with '/' as '_' (a test holds that).
Families with a variable part are functions. Imports nothing (no torch): any module may use it.

The held-out evaluation's summary (evaluation.held_out: eval_before.json, summary.json's before/after,
read by report.py and model_card.py) has keys of its own, at the end.
"""

from __future__ import annotations

# --- the update's place in the run ---------------------------------------------------------------

STEP = "step"  # updates completed (the x axis of every plot and tracker)
EPISODE = "episode"  # episodes trained on so far, all processes
SKIPPED = "skipped"  # 1 when the update was skipped (non-finite numbers), else 0
SKIP_REASON = "skip_reason"  # why, a train_checks.LIKELY_CAUSES key (skipped updates only)
LR = "lr"  # the policy's learning rate in this update
VALUE_LR = "value_lr"  # the critic's (a critic only)
HEALTH_WARNINGS = "health/warnings"  # the monitor's rule ids firing now (a list: no tracker plots it)

# --- the rollout (TRL's objective/* names: sums over response tokens, means over episodes) ---------

OBJECTIVE_KL = "objective/kl"
OBJECTIVE_ENTROPY = "objective/entropy"
OBJECTIVE_NON_SCORE_REWARD = "objective/non_score_reward"
OBJECTIVE_RLHF_REWARD = "objective/rlhf_reward"
OBJECTIVE_SCORES = "objective/scores"
OBJECTIVE_SCORES_STD = "objective/scores_std"
OBJECTIVE_KL_COEF = "objective/kl_coef"
EOS_RATE = "eos_rate"
RESPONSE_LENGTH = "response_length"
SAMPLES_DISTINCT_1 = "samples/distinct_1"
SAMPLES_DISTINCT_2 = "samples/distinct_2"
VAL_EXPLAINED_VARIANCE = "val/explained_variance"  # a critic only
VAL_MEAN = "val/mean"  # a critic only
REWARD_STD = "reward_std"  # generation.num_generations >= 2 only (TRL's name)
FRAC_REWARD_ZERO_STD = "frac_reward_zero_std"  # generation.num_generations >= 2 only (TRL's name)
ROLLOUT_LOGPROB_DIFF_MEAN = "rollout/logprob_diff_mean"  # a separate sampler (vLLM) only
ROLLOUT_LOGPROB_DIFF_MAX = "rollout/logprob_diff_max"
REWARD_OVERLONG = "reward/overlong"  # reward.overlong_buffer > 0: the mean overlong penalty (a reward_component)
REWARD_FAILED_RATE = "reward/failed_rate"  # reward components that can fail (functions, servers, judges) only


# --- ppo.filter_groups (DAPO's dynamic sampling) only ----------------------------------------------

FILTER_KEPT_GROUPS = "filter/kept_groups"  # groups trained on, all processes (those whose completions scored apart)
FILTER_ROUNDS = "filter/rounds"  # sampling rounds this update: 1 + the extra rounds
FILTER_GENERATED_EPISODES = "filter/generated_episodes"  # episodes sampled and scored this update, all processes
FILTER_FILL = "filter/fill"  # kept groups / rollout_batch_size groups of every process: 1 when the batch filled


def reward_component(name: str) -> str:
    """A reward component's mean over the episodes it scored (``name``: its display name)."""
    return f"reward/{name}"


def reward_component_failed_rate(name: str) -> str:
    """The share of episodes a component that can fail left without a reward."""
    return f"{REWARD_FAILED_RATE}/{name}"


# --- the optimisation (TRL's *_avg: means over micro-batches) --------------------------------------

POLICY_APPROXKL_AVG = "policy/approxkl_avg"
POLICY_CLIPFRAC_AVG = "policy/clipfrac_avg"
POLICY_CLIPFRAC_LOW = "policy/clipfrac_low"
POLICY_CLIPFRAC_HIGH = "policy/clipfrac_high"
POLICY_ENTROPY_AVG = "policy/entropy_avg"
POLICY_ENTROPY_THRESHOLD = "policy/entropy_threshold"  # ppo.top_entropy_quantile < 1 only: the micro-batches' mean
POLICY_GRAD_NORM = "policy/grad_norm"
LOSS_POLICY_AVG = "loss/policy_avg"
LOSS_VALUE_AVG = "loss/value_avg"  # a critic only
LOSS_KL_AVG = "loss/kl_avg"  # ppo.kl_penalty loss only
VAL_CLIPFRAC_AVG = "val/clipfrac_avg"  # a critic only
VAL_RATIO = "val/ratio"
VAL_RATIO_FIRST_MINIBATCH = "val/ratio_first_minibatch"
PPO_EPOCHS_RUN = "ppo/epochs_run"
PPO_SKIPPED_STEPS = "ppo/skipped_steps"

# --- episodes of several turns (the environment section) --------------------------------------------

ENV_TURNS = "env/turns"  # assistant turns per episode
ENV_TOOL_CALLS = "env/tool_calls"  # tool calls per episode (type tools)
ENV_TOOL_ERRORS = "env/tool_errors"  # calls answered with an error: raised, timed out, unknown, malformed
ENV_FAILED_RATE = "env/failed_rate"  # episodes whose environment failed (they left the update)
ENV_OBSERVATION_TOKENS = "env/observation_tokens"  # the environment's tokens per episode


def env_ended_by(reason: str) -> str:
    """The fraction of episodes that ended by ``reason``: done, max_turns, max_episode_tokens or max_new_tokens."""
    return f"env/ended_by/{reason}"


ENV_ENDED_BY_MAX_EPISODE_TOKENS = env_ended_by("max_episode_tokens")  # the health rule's


# --- time, speed and memory ------------------------------------------------------------------------

TIME_ROLLOUT_S = "time/rollout_s"
TIME_UPDATE_S = "time/update_s"
TIME_STEP_S = "time/step_s"
TIME_STEP_CPU_S = "time/step_cpu_s"
TOKENS_PER_S = "tokens_per_s"
PERF_DECODE_GBPS = "perf/decode_gbps"
PERF_MFU_ROLLOUT = "perf/mfu_rollout"  # where the precision probe ran only
PERF_MFU_UPDATE = "perf/mfu_update"


def memory_peak_gb(phase: str) -> str:
    """The most GB of accelerator memory a phase ("rollout", "update") held in this update (CUDA only)."""
    return f"memory/{phase}_peak_gb"


# --- the held-out evaluation's summary (not metrics.jsonl) -----------------------------------------

HELD_OUT_SCORE = "score"  # mean reward of the rows that got one
HELD_OUT_REWARD_FAILED = "reward_failed"  # rows without a reward
HELD_OUT_EOS_RATE = "eos_rate"
HELD_OUT_RESPONSE_LENGTH = "response_length"  # tokens
HELD_OUT_KL = "kl"  # nats per response (k1, summed over its tokens)
