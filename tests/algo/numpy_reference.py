"""Plain-loop numpy references for the critic-free estimators, written from the formulas alone.

Nothing here calls ppo_cli or torch: every statistic is an explicit loop over rows, groups and tokens,
so a vectorisation slip in ppo_cli/algo/ (a wrong axis, a mask applied late, the wrong std) shows up
as a mismatch in tests/algo/test_critic_free_reference.py and tests/algo/test_estimators.py. Masks are
lists/arrays of bools; a row's action tokens are the positions where its mask is True. A mask may have
holes (an environment's tokens between the policy's): every per-token recursion runs over a row's
action tokens as one sequence, listed by ``action_positions``, and writes back at their positions.
"""

import math

import numpy as np


def sample_std(values):
    """Bessel-corrected std of a list of floats (n >= 2)."""
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def group_advantages(scores, group_size, scale_rewards, eps):
    out = np.zeros(len(scores))
    batch_std = sample_std(list(scores))
    for start in range(0, len(scores), group_size):
        group = [float(s) for s in scores[start:start + group_size]]
        mean = sum(group) / group_size
        std = {"group": sample_std(group), "batch": batch_std, "none": None}[scale_rewards]
        for j, score in enumerate(group):
            centred = score - mean
            out[start + j] = centred if std is None else centred / (std + eps)
    return out


def rloo_advantages(scores, group_size):
    out = np.zeros(len(scores))
    for start in range(0, len(scores), group_size):
        group = [float(s) for s in scores[start:start + group_size]]
        for i in range(group_size):
            others = [group[j] for j in range(group_size) if j != i]
            out[start + i] = group[i] - sum(others) / len(others)
    return out


def group_reward_stats(scores, group_size):
    stds, zero = [], 0
    for start in range(0, len(scores), group_size):
        group = [float(s) for s in scores[start:start + group_size]]
        stds.append(sample_std(group))
        zero += all(s == group[0] for s in group)
    return np.array(stds), sum(stds) / len(stds), zero / len(stds)


def action_positions(mask_row):
    """The positions of a row's action tokens, in order: the compacted sequence."""
    return [t for t in range(len(mask_row)) if mask_row[t]]


def shape_rewards(scores, kl, kl_coef, mask):
    """(rewards, non_score_rewards): -kl_coef * kl_t on action tokens, the score added on the last one."""
    batch, length = kl.shape
    rewards, non_score = np.zeros((batch, length)), np.zeros((batch, length))
    for b in range(batch):
        real = action_positions(mask[b])
        for t in real:
            non_score[b, t] = rewards[b, t] = -kl_coef * kl[b, t]
        if real:
            rewards[b, real[-1]] += scores[b]
    return rewards, non_score


def gae(rewards, values, mask, gamma, lam):
    """(advantages, returns) by the GAE recursion over each row's action tokens, i indexing them."""
    batch, length = rewards.shape
    advantages, returns = np.zeros((batch, length)), np.zeros((batch, length))
    for b in range(batch):
        real = action_positions(mask[b])
        advantage = 0.0
        for i in reversed(range(len(real))):
            t = real[i]
            next_value = values[b, real[i + 1]] if i + 1 < len(real) else 0.0
            advantage = rewards[b, t] + gamma * next_value - values[b, t] + gamma * lam * advantage
            advantages[b, t], returns[b, t] = advantage, advantage + values[b, t]
    return advantages, returns


def reinforce_returns(scores, kl, kl_coef, mask, gamma):
    """Per-token reward -kl_coef * kl_t (+ score on the last action token), discounted sum to the end,
    gamma once per action token: return_i = sum_{j >= i} gamma^(j - i) r_j over the compacted row."""
    rewards, _ = shape_rewards(scores, kl, kl_coef, mask)
    batch, length = kl.shape
    returns = np.zeros((batch, length))
    for b in range(batch):
        real = action_positions(mask[b])
        for i, t in enumerate(real):
            returns[b, t] = sum(gamma ** (j - i) * rewards[b, real[j]] for j in range(i, len(real)))
    return returns


def whiten(values, mask, eps=1e-8, keep_mean=False):
    real = [values[b, t] for b in range(values.shape[0]) for t in range(values.shape[1]) if mask[b][t]]
    mean = sum(real) / len(real)
    var = sum((v - mean) ** 2 for v in real) / max(1, len(real) - 1)
    out = np.zeros(values.shape)
    for b in range(values.shape[0]):
        for t in range(values.shape[1]):
            if mask[b][t]:
                out[b, t] = (values[b, t] - mean) / math.sqrt(var + eps) + (mean if keep_mean else 0.0)
    return out


def reinforce_plus_plus(scores, kl, kl_coef, mask, gamma):
    returns = reinforce_returns(scores, kl, kl_coef, mask, gamma)
    return whiten(returns, mask), returns


def reinforce_plus_plus_baseline(scores, kl, kl_coef, mask, group_size, gamma):
    centred = group_advantages(scores, group_size, "none", 0.0)
    return reinforce_plus_plus(centred, kl, kl_coef, mask, gamma)


def gae_estimator(scores, kl, kl_coef, values, mask, gamma, lam, whiten_rewards, whiten_advantages):
    """(rewards, non_score_rewards, advantages, returns) of PPO's estimator."""
    rewards, non_score = shape_rewards(scores, kl, kl_coef, mask)
    if whiten_rewards:
        rewards = whiten(rewards, mask, keep_mean=True)
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    if whiten_advantages:
        advantages = whiten(advantages, mask)
    return rewards, non_score, advantages, returns


def sequence_estimator(name, scores, kl, kl_coef, mask, group_size, scale_rewards="group", eps=1e-4):
    """grpo or rloo: (rewards, non_score_rewards, advantages, returns); the KL summed over the action
    tokens joins the score, then each sequence's advantage sits on each of its action tokens."""
    rewards, non_score = shape_rewards(scores, kl, kl_coef, mask)
    sequence_rewards = [scores[b] + sum(non_score[b, t] for t in action_positions(mask[b])) for b in range(len(scores))]
    if name == "grpo":
        sequence = group_advantages(sequence_rewards, group_size, scale_rewards, eps)
    else:
        sequence = rloo_advantages(sequence_rewards, group_size)
    advantages = np.zeros(kl.shape)
    for b in range(len(scores)):
        for t in action_positions(mask[b]):
            advantages[b, t] = sequence[b]
    return rewards, non_score, advantages, advantages


def reinforce_estimator(scores, kl, kl_coef, mask, group_size, gamma):
    """reinforce_pp: (rewards of the raw scores, non_score_rewards, advantages, returns)."""
    rewards, non_score = shape_rewards(scores, kl, kl_coef, mask)
    if group_size > 1:
        advantages, returns = reinforce_plus_plus_baseline(scores, kl, kl_coef, mask, group_size, gamma)
    else:
        advantages, returns = reinforce_plus_plus(scores, kl, kl_coef, mask, gamma)
    return rewards, non_score, advantages, returns


def aggregate(loss, mask, mode, max_response_length=None):
    batch, length = loss.shape
    if mode == "token_mean":
        real = [loss[b, t] for b in range(batch) for t in range(length) if mask[b][t]]
        return sum(real) / max(1, len(real))
    per_row = []
    for b in range(batch):
        real = [loss[b, t] for t in range(length) if mask[b][t]]
        divisor = max(1, len(real)) if mode == "seq_mean_token_mean" else max_response_length
        per_row.append(sum(real) / divisor)
    return sum(per_row) / batch


def clipped_surrogate(ratio, advantage, eps_low, eps_high):
    """One token: (loss, clipped on the low side, clipped on the high side)."""
    clipped_ratio = min(max(ratio, 1 - eps_low), 1 + eps_high)
    loss = max(-advantage * ratio, -advantage * clipped_ratio)
    return loss, ratio < 1 - eps_low and advantage < 0, ratio > 1 + eps_high and advantage > 0


def sequence_log_ratios(logprobs, old_logprobs, mask):
    """(B,) 1/|y_i| * sum over real tokens of logprobs - old_logprobs; 0 for an empty row."""
    out = np.zeros(logprobs.shape[0])
    for b in range(logprobs.shape[0]):
        diffs = [logprobs[b, t] - old_logprobs[b, t] for t in range(logprobs.shape[1]) if mask[b][t]]
        out[b] = sum(diffs) / len(diffs) if diffs else 0.0
    return out


def policy_loss(logprobs, old_logprobs, advantages, mask, eps_low, eps_high, ratio_level, mode, max_response_length):
    """(loss, clipfrac, clipfrac_low, clipfrac_high) of the clipped surrogate."""
    batch, length = logprobs.shape
    seq = sequence_log_ratios(logprobs, old_logprobs, mask)
    per_token = np.zeros((batch, length))
    low = high = count = 0
    for b in range(batch):
        for t in range(length):
            if not mask[b][t]:
                continue
            log_ratio = logprobs[b, t] - old_logprobs[b, t] if ratio_level == "token" else seq[b]
            per_token[b, t], is_low, is_high = clipped_surrogate(math.exp(log_ratio), advantages[b, t], eps_low, eps_high)
            low, high, count = low + is_low, high + is_high, count + 1
    count = max(1, count)
    return aggregate(per_token, mask, mode, max_response_length), (low + high) / count, low / count, high / count


def mask_truncated(mask, finished):
    return np.array([[bool(mask[b][t]) and bool(finished[b]) for t in range(len(mask[b]))] for b in range(len(mask))])


def k3(logprobs, ref_logprobs):
    """TRL GRPO's per_token_kl, elementwise: exp(ref - logp) - (ref - logp) - 1."""
    out = np.zeros(logprobs.shape)
    for index in np.ndindex(logprobs.shape):
        diff = ref_logprobs[index] - logprobs[index]
        out[index] = math.exp(diff) - diff - 1
    return out


def soft_overlong_punishment(length, max_length, buffer, penalty):
    """DAPO's overlong reward, written as TRL's get_soft_overlong_punishment (three cases) times penalty."""
    if length <= max_length - buffer:
        return 0.0
    if length <= max_length:
        return penalty * (max_length - buffer - length) / buffer
    return -penalty


def high_entropy_mask(entropy, mask, top_quantile):
    """TRL's get_high_entropy_mask on one process: the masked entropies' (1 - q) quantile (linear), then >=."""
    values = sorted(float(entropy[i][t]) for i in range(len(mask)) for t in range(len(mask[i])) if mask[i][t])
    if not values:
        return [[False] * len(row) for row in mask], 0.0
    position = (1.0 - top_quantile) * (len(values) - 1)
    low = math.floor(position)
    high = min(low + 1, len(values) - 1)
    threshold = values[low] + (position - low) * (values[high] - values[low])
    keep = [[bool(mask[i][t]) and float(entropy[i][t]) >= threshold for t in range(len(mask[i]))]
            for i in range(len(mask))]
    return keep, threshold
