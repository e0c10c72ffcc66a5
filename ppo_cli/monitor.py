"""Health warnings: small rules over a moving window of the training metrics.

Each rule encodes one of the usual ways PPO runs break (symptom -> cause -> fix): it looks at
the last ``window`` updates of a few metrics and, when its pattern shows, says what it sees (with the
numbers), the likely cause and the fix, in plain words.

    monitor = HealthMonitor(recipe.monitor)
    for metrics in training:
        for warning in monitor.observe(metrics, step):  # new warnings, and reminders
            show("warning", asdict(warning))            # observe.py: to the CLI's screen
        metrics["health/warnings"] = monitor.active     # rule ids active now

A warning is returned when its rule starts firing, and again every ``repeat_every`` updates while it
keeps firing (a rule that flickers on and off is not repeated more often than that). Nothing fires
before a full window, except the ratio check, which needs 3 updates, and the failed-reward check, which
reads the latest update alone (a reward that fails is news at once).

Level rules (clip fraction, approx-KL, KL per token, EOS rate, ratio) average the window. Trend rules
(KL growing, value loss rising, reward vs distinct-1) call a series rising when Kendall's tau over the
window passes ``trend`` (scale-free; pure noise passes 0.5 about 2% of the time on 10 points) and
compare the window's recent half with a reference level: KL with its level at the end of the first
window, the value loss with its lowest window mean, distinct-1 with its first window. KL growing and
value loss rising also skip the first window, where both move away from their start by design.

Pure Python (no torch, no numpy), so it can be tested with hand-written metric streams.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

from ppo_cli.metric_names import (
    EOS_RATE, FILTER_FILL, FRAC_REWARD_ZERO_STD, LOSS_VALUE_AVG, OBJECTIVE_KL, OBJECTIVE_KL_COEF, OBJECTIVE_SCORES, POLICY_APPROXKL_AVG,
    POLICY_CLIPFRAC_AVG, POLICY_ENTROPY_AVG, REWARD_FAILED_RATE, RESPONSE_LENGTH, SAMPLES_DISTINCT_1,
    VAL_RATIO_FIRST_MINIBATCH, ENV_ENDED_BY_MAX_EPISODE_TOKENS, ENV_TOOL_CALLS, ENV_TOOL_ERRORS,
)
from ppo_cli.recipe import MonitorConfig

# The metrics the rules read.
WATCHED = (POLICY_CLIPFRAC_AVG, POLICY_APPROXKL_AVG, OBJECTIVE_KL, OBJECTIVE_KL_COEF, LOSS_VALUE_AVG, POLICY_ENTROPY_AVG,
           OBJECTIVE_SCORES, SAMPLES_DISTINCT_1, EOS_RATE, VAL_RATIO_FIRST_MINIBATCH, RESPONSE_LENGTH,
           FRAC_REWARD_ZERO_STD, REWARD_FAILED_RATE, ENV_ENDED_BY_MAX_EPISODE_TOKENS, ENV_TOOL_CALLS, ENV_TOOL_ERRORS,
           FILTER_FILL)

BASELINE_UPDATES = 3  # the entropy "at the start" is the mean of the first few updates
RATIO_UPDATES = 3  # a log-prob mismatch shows from the first update: do not wait a whole window


@dataclass(frozen=True)
class HealthWarning:
    rule: str  # the rule id, e.g. "clipfrac_high"
    message: str  # what is seen, with the numbers
    cause: str  # the likely cause
    fix: str  # what to change (recipe keys named)
    step: int  # the update at which it is reported
    value: float  # the number that crossed the threshold
    since: int  # the update at which this episode of the rule began (== step when new)


class History:
    """The last ``window`` values of each watched metric, the first ``window`` values (the run's
    start), the lowest window mean so far, and how many updates were seen."""

    def __init__(self, window: int):
        self.window = window
        self.seen = 0
        self.series: dict[str, deque] = {name: deque(maxlen=window) for name in WATCHED}
        self.first: dict[str, list[float]] = {name: [] for name in WATCHED}
        self.lowest_mean: dict[str, float] = {}

    def add(self, metrics: Mapping[str, object]) -> None:
        self.seen += 1
        for name in WATCHED:
            value = metrics.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.series[name].append(float(value))
                if len(self.first[name]) < self.window:
                    self.first[name].append(float(value))
                if len(self.series[name]) == self.window and math.isfinite(now := mean(self.series[name])):
                    self.lowest_mean[name] = min(now, self.lowest_mean.get(name, now))

    def start_level(self, name: str) -> Optional[float]:
        """The level a metric reached by the end of the first window (mean of its second half)."""
        first = self.first[name]
        return mean(first[self.window // 2 :]) if len(first) == self.window else None

    def window_of(self, name: str, skip_first_window: bool = False) -> Optional[list[float]]:
        """The full window of ``name``, or None while there are fewer values (or, with
        ``skip_first_window``, while the window still reaches into the first ``window`` updates)."""
        values = self.series[name]
        if len(values) < self.window or (skip_first_window and self.seen < 2 * self.window):
            return None
        return list(values)

    def recent(self, name: str, count: int) -> Optional[list[float]]:
        values = list(self.series[name])[-count:]
        return values if len(values) == count else None

    def latest(self, name: str) -> Optional[float]:
        return self.series[name][-1] if self.series[name] else None


# --- small statistics -----------------------------------------------------------------------------


def mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def recent_half_mean(values: Sequence[float]) -> float:
    """Mean of the window's most recent half: where a trend has got to, with the noise averaged."""
    return mean(values[-max(1, len(values) // 2) :])


def kendall_tau(values: Sequence[float]) -> float:
    """Kendall's tau of the values against time: +1 always rising, -1 always falling, ~0 noise.

    tau = (concordant - discordant pairs) / all pairs. On 10 points of pure noise it passes 0.5 about
    2% of the time; it ignores the scale, so one rule works for KL in nats and losses of any size.
    """
    n = len(values)
    if n < 2:
        return 0.0
    score = sum((values[j] > values[i]) - (values[j] < values[i]) for i in range(n) for j in range(i + 1, n))
    return score / (n * (n - 1) / 2)


# --- the rules -------------------------------------------------------------------------------------

Check = Callable[[History, MonitorConfig], Optional[tuple[float, str]]]


@dataclass(frozen=True)
class Rule:
    id: str
    check: Check  # (history, config) -> (value, message) when the rule fires, else None
    cause: str
    fix: str


RULES: list[Rule] = []


def rule(rule_id: str, cause: str, fix: str) -> Callable[[Check], Check]:
    def register(check: Check) -> Check:
        RULES.append(Rule(rule_id, check, cause, fix))
        return check

    return register


@rule(
    "clipfrac_high",
    cause="each optimizer step moves the policy too far in ratio space: most tokens hit the clip and "
    "the gradient becomes erratic, so the reward grows slowly and noisily",
    fix="lower optim.lr by 2x, or cut ppo.ppo_epochs (e.g. from 4 to 2)",
)
def _clipfrac_high(h: History, c: MonitorConfig):
    values = h.window_of(POLICY_CLIPFRAC_AVG)
    if values is not None and mean(values) > c.clipfrac_high:
        return mean(values), f"clip fraction {mean(values):.2f} over the last {len(values)} updates is above {c.clipfrac_high:g}"
    return None


@rule(
    "clipfrac_low",
    cause="the policy barely changes per update: the learning rate is too low or the prompts too "
    "narrow (or the run has converged and there is nothing left to learn)",
    fix="raise optim.lr carefully (2x) or widen data.prompts; if the reward is at its ceiling, stop the run here",
)
def _clipfrac_low(h: History, c: MonitorConfig):
    values, scores = h.window_of(POLICY_CLIPFRAC_AVG), h.window_of(OBJECTIVE_SCORES)
    if values is None or scores is None or mean(values) >= c.clipfrac_low or kendall_tau(scores) >= c.trend:
        return None
    return mean(values), (
        f"clip fraction {mean(values):.3f} over the last {len(values)} updates is below {c.clipfrac_low:g} "
        f"and the reward is not rising"
    )


@rule(
    "approx_kl_high",
    cause="the updated policy ends far from the policy that sampled the batch, so the clipped "
    "objective no longer keeps each update inside a trust region",
    fix="lower optim.lr by 2x, use fewer ppo.ppo_epochs, or set ppo.max_kl (e.g. 0.1) to stop the epochs early",
)
def _approx_kl_high(h: History, c: MonitorConfig):
    values = h.window_of(POLICY_APPROXKL_AVG)
    if values is not None and mean(values) > c.approx_kl_high:
        return mean(values), f"approx-KL {mean(values):.3f} per update over the last {len(values)} updates is above {c.approx_kl_high:g}"
    return None


@rule(
    "kl_growing",
    cause="the KL penalty is too weak to hold the policy near the reference; runs like this tend to "
    "collapse into a degenerate output (a fixed phrase) that the reward model happens to score high",
    fix="raise ppo.kl_coef by 2x (or set ppo.adaptive_kl with a target KL) and restart from a checkpoint before the rise",
)
def _kl_growing(h: History, c: MonitorConfig):
    # KL always rises from 0 at first and usually levels off; "without bound" is a rise that goes on
    # after the first window and has carried KL well past the level it had reached by then.
    values, start = h.window_of(OBJECTIVE_KL, skip_first_window=True), h.start_level(OBJECTIVE_KL)
    if values is None or start is None:
        return None
    now = recent_half_mean(values)
    if kendall_tau(values) >= c.trend and now > c.kl_zero and now >= c.kl_growth * max(start, 0.0):
        note = "; ppo.kl_coef is 0, so nothing holds the policy back" if h.latest(OBJECTIVE_KL_COEF) == 0 else ""
        return now, (
            f"KL to the reference keeps rising: {now:.2f} nats now, {now / max(start, 1e-12):.1f}x the {start:.2f} "
            f"it had reached by update {h.window}{note}"
        )
    return None


@rule(
    "kl_high",
    cause="the policy has drifted far from the reference: its responses are ones the reference model "
    "would rarely write, which is where reward models stop being reliable; the KL penalty is too weak "
    "(or off) for this learning rate",
    fix="raise ppo.kl_coef (or set ppo.adaptive_kl with a target KL), or lower optim.lr",
)
def _kl_high(h: History, c: MonitorConfig):
    kl, length = h.window_of(OBJECTIVE_KL), h.window_of(RESPONSE_LENGTH)
    if kl is None or length is None or mean(length) <= 0:
        return None
    per_token = mean(kl) / mean(length)
    if per_token > c.kl_per_token_high:
        note = "; ppo.kl_coef is 0" if h.latest(OBJECTIVE_KL_COEF) == 0 else ""
        return per_token, (
            f"KL to the reference is {per_token:.2f} nats per response token over the last {len(kl)} updates "
            f"({mean(kl):.1f} nats per response), above {c.kl_per_token_high:g}{note}"
        )
    return None


@rule(
    "kl_zero",
    cause="the reference is the live policy (the same model object, or the LoRA adapter left on for the "
    "reference pass), so the KL penalty is always zero; or the learning rate is so small nothing moves",
    fix="make the reference a separately loaded frozen model (check reference.path and the adapter "
    "switching); if optim.lr is tiny, raise it",
)
def _kl_zero(h: History, c: MonitorConfig):
    values = h.window_of(OBJECTIVE_KL)
    if values is not None and h.seen > h.window and max(abs(v) for v in values) < c.kl_zero:
        peak = max(abs(v) for v in values)
        return peak, f"KL to the reference stayed below {c.kl_zero:g} nats for the last {len(values)} updates"
    return None


@rule(
    "value_loss_rising",
    cause="the value head is diverging instead of fitting the returns: its learning rate is too high "
    "for it, or the value update is not clipped tightly enough",
    fix="lower optim.value_lr about 5x (metrics.jsonl's value_lr is the rate in use), tighten ppo.cliprange_value, "
    "or lower ppo.vf_coef",
)
def _value_loss_rising(h: History, c: MonitorConfig):
    latest = h.latest(LOSS_VALUE_AVG)
    if latest is not None and not math.isfinite(latest):
        return latest, f"the value loss is {latest}"
    values, lowest = h.window_of(LOSS_VALUE_AVG, skip_first_window=True), h.lowest_mean.get(LOSS_VALUE_AVG)
    if values is None or lowest is None:
        return None
    now = recent_half_mean(values)
    if kendall_tau(values) >= c.trend and now > 0 and now >= c.value_loss_growth * max(lowest, 0.0):
        return now, (
            f"value loss keeps rising: {now:.3g} now, {now / max(lowest, 1e-12):.1f}x its lowest "
            f"{len(values)}-update mean ({lowest:.3g})"
        )
    return None


@rule(
    "entropy_collapse",
    cause="the policy is collapsing to one near-certain output per prompt: exploration stops and the "
    "per-token gradients grow large",
    fix="raise ppo.kl_coef, add an entropy bonus (ppo.entropy_coef, e.g. 0.01), or lower optim.lr",
)
def _entropy_collapse(h: History, c: MonitorConfig):
    values, start = h.window_of(POLICY_ENTROPY_AVG), h.first[POLICY_ENTROPY_AVG][:BASELINE_UPDATES]
    if values is None or len(start) < BASELINE_UPDATES:
        return None
    baseline = mean(start)
    if baseline > 0 and mean(values) < c.entropy_drop * baseline:
        now = mean(values)
        return now, (
            f"policy entropy fell to {now:.3f} nats/token over the last {len(values)} updates, "
            f"{now / baseline:.0%} of the {baseline:.3f} it started at"
        )
    return None


@rule(
    "reward_hacking",
    cause="the reward rises while the responses grow more alike: the policy has likely found a phrase "
    "or pattern the reward model over-rates (reward hacking / mode collapse)",
    fix="read the latest samples.jsonl; raise ppo.kl_coef, and fix the reward (penalise the pattern) if it is exploited",
)
def _reward_hacking(h: History, c: MonitorConfig):
    scores, distinct = h.window_of(OBJECTIVE_SCORES), h.window_of(SAMPLES_DISTINCT_1)
    if scores is None or distinct is None:
        return None
    start, now = mean(h.first[SAMPLES_DISTINCT_1]), recent_half_mean(distinct)  # the start: the run's first window
    if kendall_tau(scores) >= c.trend and kendall_tau(distinct) <= -c.trend and now <= (1 - c.distinct_drop) * start:
        return now, (
            f"the reward keeps rising while distinct-1 of the responses keeps falling: {now:.2f} now, "
            f"{start:.2f} over the first {len(h.first[SAMPLES_DISTINCT_1])} updates"
        )
    return None


@rule(
    "eos_stuck",
    cause="no response ends within generation.max_new_tokens: the stop token is wrong, the limit is "
    "too short, or nothing rewards ending (truncated responses also push the reward model out of distribution)",
    fix="set reward.missing_eos_penalty (10 is usual with scores near +-10), check generation.stop_token against the "
    "tokenizer's EOS, or raise generation.max_new_tokens",
)
def _eos_stuck(h: History, c: MonitorConfig):
    values = h.window_of(EOS_RATE)
    if values is not None and max(values) <= c.eos_rate_floor:
        return max(values), f"EOS rate stayed at {max(values):.0%} for the last {len(values)} updates"
    return None


@rule(
    "groups_without_signal",
    cause="most prompts' completions all score the same, and a group of equal scores gives every completion "
    "advantage 0 (grpo, rloo): the update learns from the few groups left, or from nothing. The completions are "
    "too alike, or the task is too easy (all pass) or too hard (all fail) for the policy",
    fix="raise generation.temperature or generation.num_generations; or give the reward finer steps, or easier "
    "or harder prompts in data.prompts",
)
def _groups_without_signal(h: History, c: MonitorConfig):
    values = h.window_of(FRAC_REWARD_ZERO_STD)
    if values is not None and mean(values) > c.zero_std_groups_high:
        return mean(values), (
            f"{mean(values):.0%} of the prompt groups scored all their completions the same over the last "
            f"{len(values)} updates (above {c.zero_std_groups_high:g})"
        )
    return None


@rule(
    "filter_rounds_exhausted",
    cause="ppo.filter_groups sampled ppo.max_filter_rounds extra rounds and still found fewer than rollout_batch_size "
    "groups whose completions scored apart: most prompts are all-pass or all-fail for the policy, and the updates "
    "train on smaller batches (filter/kept_groups) while each costs up to 1 + max_filter_rounds rollouts",
    fix="raise ppo.max_filter_rounds, generation.num_generations or generation.temperature; or give data.prompts "
    "prompts nearer the policy's level (drop those it always or never solves)",
)
def _filter_rounds_exhausted(h: History, c: MonitorConfig):
    values = h.window_of(FILTER_FILL)
    if values is None:
        return None
    short = sum(1 for v in values if v < 1.0) / len(values)
    if short > c.filter_short_high:
        return short, (
            f"{short:.0%} of the last {len(values)} updates ran out of filter rounds with the batch short "
            f"({mean(values):.0%} full on average; above {c.filter_short_high:g})"
        )
    return None


@rule(
    "reward_failures",
    cause="the reward failed for some completions (a server that timed out or answered 5xx after its retries, an "
    "answer that was not JSON or had the wrong length, a judge answer with no number, a None from every function); they "
    "left the update, so it learns from fewer episodes",
    fix="see reward/failed_rate/NAME in metrics.jsonl for the component; raise its timeout_s or retries under "
    "reward.components, lower its max_concurrency or batch_size if the server is overloaded, or fix what it answers; "
    "monitor.reward_failed_high sets the share tolerated without a warning",
)
def _reward_failures(h: History, c: MonitorConfig):
    value = h.latest(REWARD_FAILED_RATE)
    if value is not None and value > c.reward_failed_high:
        return value, f"{value:.0%} of the completions got no reward at the last update (above {c.reward_failed_high:g})"
    return None


@rule(
    "episodes_cut_by_budget",
    cause="most episodes of several turns ran out of environment.max_episode_tokens before they were done: the "
    "policy never sees how they end, and the rewards score a last message cut short",
    fix="raise environment.max_episode_tokens, lower environment.max_observation_tokens (long tool answers are cut "
    "in the middle), or lower environment.max_turns so that episodes end by max_turns",
)
def _episodes_cut_by_budget(h: History, c: MonitorConfig):
    values = h.window_of(ENV_ENDED_BY_MAX_EPISODE_TOKENS)
    if values is not None and mean(values) > c.episode_budget_high:
        return mean(values), (
            f"{mean(values):.0%} of the episodes ended by environment.max_episode_tokens over the last {len(values)} "
            f"updates (above {c.episode_budget_high:g})"
        )
    return None


@rule(
    "tool_errors",
    cause="most of the policy's tool calls were answered with an error (the tool raised or timed out, an unknown "
    "tool, arguments its signature does not take, a call that is not valid JSON): the policy learns from the error "
    "texts, not from what the tool computes",
    fix="run `ppo rollout` and read the tool messages: fix the tool if it raises, raise environment.timeout_s if it "
    "times out, check the tool's name and argument names in its schema if the calls are refused",
)
def _tool_errors(h: History, c: MonitorConfig):
    calls, errors = h.window_of(ENV_TOOL_CALLS), h.window_of(ENV_TOOL_ERRORS)
    if calls is None or errors is None or sum(calls) == 0:
        return None
    share = sum(errors) / sum(calls)
    if share > c.tool_errors_high:
        return share, (f"{share:.0%} of the tool calls were answered with an error over the last {len(calls)} updates "
                       f"(above {c.tool_errors_high:g})")
    return None


@rule(
    "ratio_mismatch",
    cause="rollout and update compute different log-probs for the same tokens: the sampling temperature "
    "applied in one and not the other, dropout left on, or different padding/attention masks",
    fix="divide the logits by generation.temperature in both places, set policy.lora.dropout to 0, and "
    "check the attention mask of the update forward",
)
def _ratio_mismatch(h: History, c: MonitorConfig):
    values = h.recent(VAL_RATIO_FIRST_MINIBATCH, min(RATIO_UPDATES, h.window))
    if values is not None and abs(mean(values) - 1.0) > c.ratio_tolerance:
        return mean(values), (
            f"the policy ratio before the first optimizer step is {mean(values):.3f} (mean of the last "
            f"{len(values)} updates), not 1"
        )
    return None


# --- the monitor -----------------------------------------------------------------------------------


@dataclass
class _Record:
    """One rule's story over the run, for the summary."""

    rule: Rule
    message: str
    value: float
    first_step: int
    since: int
    last_step: int
    last_printed: int
    updates: int = 1


class HealthMonitor:
    """Feeds each update's metrics to every rule; returns the warnings to show now."""

    def __init__(self, config: MonitorConfig | None = None, rules: Sequence[Rule] | None = None):
        self.config = config if config is not None else MonitorConfig()
        self.rules = list(RULES if rules is None else rules)
        self.history = History(self.config.window)
        self.active: list[str] = []  # rule ids firing at the latest update
        self.records: dict[str, _Record] = {}

    def observe(self, metrics: Mapping[str, object], step: int) -> list[HealthWarning]:
        if not self.config.enabled:
            return []
        self.history.add(metrics)
        shown, active = [], []
        for rule_ in self.rules:
            fired = rule_.check(self.history, self.config)
            if fired is None:
                continue
            value, message = fired
            record = self.records.get(rule_.id)
            if record is None:
                record = self.records[rule_.id] = _Record(rule_, message, value, step, step, step, step, 0)
                show = True
            else:
                # A reminder while it persists; a rule that flickers on and off is not repeated more often.
                show = step - record.last_printed >= self.config.repeat_every
                if rule_.id not in self.active:
                    record.since = step
            record.message, record.value, record.last_step = message, value, step
            record.updates += 1
            active.append(rule_.id)
            if show:
                record.last_printed = step
                shown.append(HealthWarning(rule_.id, message, rule_.cause, rule_.fix, step, value, record.since))
        self.active = active
        return shown

    def summary(self) -> list[dict]:
        """Every rule that fired during the run, in the order they first fired (plain data for summary.json)."""
        return [
            {
                "rule": r.rule.id, "message": r.message, "cause": r.rule.cause, "fix": r.rule.fix, "value": r.value,
                "first_step": r.first_step, "last_step": r.last_step, "updates": r.updates,
                "active_at_end": r.rule.id in self.active,
            }
            for r in sorted(self.records.values(), key=lambda r: r.first_step)
        ]
