"""The health monitor on synthetic metric streams: each rule fires on its pattern, and only then."""

from __future__ import annotations

import math
import random
import re
import typing

import pytest
from pydantic import BaseModel

from ppo_cli.monitor import RULES, HealthMonitor, HealthWarning, kendall_tau
from ppo_cli.recipe import MonitorConfig, Recipe


def healthy(step: int, rng: random.Random) -> dict:
    """One update of a run going well: reward climbs then plateaus, KL rises then levels off, the
    value loss falls, clip fraction and approx-KL sit in their healthy bands."""
    noise = lambda scale: rng.gauss(0.0, scale)  # noqa: E731
    return {
        "step": step,
        "objective/scores": 8.0 * (1 - math.exp(-step / 15)) - 2.0 + noise(0.3),
        "objective/kl": 6.0 * (1 - math.exp(-step / 8)) + noise(0.2),
        "objective/kl_coef": 0.05,
        "policy/clipfrac_avg": 0.15 + noise(0.02),
        "policy/approxkl_avg": 0.02 + abs(noise(0.005)),
        "loss/value_avg": 1.0 / (1 + 0.05 * step) + abs(noise(0.05)),
        "policy/entropy_avg": 1.2 + 0.3 * math.exp(-step / 50) + noise(0.03),
        "samples/distinct_1": 0.55 + noise(0.02),
        "samples/distinct_2": 0.8 + noise(0.02),
        "eos_rate": min(1.0, 0.3 + step / 40),
        "response_length": 40.0 + noise(1.0),
        "val/ratio_first_minibatch": 1.0 + noise(1e-4),
        "health/warnings": [],  # what metrics.jsonl carries; the monitor ignores non-numbers
    }


def run_stream(updates: int, config: MonitorConfig | None = None, seed: int = 0, **patterns) -> tuple[HealthMonitor, list[HealthWarning]]:
    """Feed ``updates`` healthy updates, with each metric in ``patterns`` (name -> f(step)) replaced."""
    rng, monitor, raised = random.Random(seed), HealthMonitor(config or MonitorConfig()), []
    for step in range(1, updates + 1):
        metrics = healthy(step, rng)
        for name, pattern in patterns.items():
            metrics[name.replace("__", "/")] = pattern(step)
        raised += monitor.observe(metrics, step)
    return monitor, raised


@pytest.mark.parametrize("seed", range(5))
def test_healthy_run_raises_no_warning(seed):
    monitor, raised = run_stream(200, seed=seed)
    assert raised == [] and monitor.active == [] and monitor.summary() == []


jitter = lambda step, scale=0.01: scale * math.sin(step * 1.7)  # noqa: E731  deterministic wiggle

RULE_CASES = {
    # rule id: (patterns, first update at which it must have fired)
    "clipfrac_high": ({"policy__clipfrac_avg": lambda s: 0.6 + jitter(s)}, 10),
    "clipfrac_low": ({"policy__clipfrac_avg": lambda s: 0.01, "objective__scores": lambda s: 2.0 + jitter(s, 0.3)}, 10),
    "approx_kl_high": ({"policy__approxkl_avg": lambda s: 0.3 + jitter(s)}, 10),
    "kl_growing": ({"objective__kl": lambda s: 0.8 * s + jitter(s)}, 20),  # first window skipped
    "kl_high": ({"objective__kl": lambda s: 60.0 + jitter(s, 1.0)}, 10),  # 1.5 nats per token
    "kl_zero": ({"objective__kl": lambda s: 0.0}, 11),
    "value_loss_rising": ({"loss__value_avg": lambda s: 0.5 * 1.15 ** s}, 20),
    "entropy_collapse": ({"policy__entropy_avg": lambda s: 1.5 * 0.8 ** s}, 20),
    "reward_hacking": ({"objective__scores": lambda s: 0.3 * s + jitter(s), "samples__distinct_1": lambda s: 0.7 * 0.95 ** s}, 15),
    "eos_stuck": ({"eos_rate": lambda s: 0.0}, 10),
    "ratio_mismatch": ({"val__ratio_first_minibatch": lambda s: 0.7 + jitter(s)}, 3),
    "groups_without_signal": ({"frac_reward_zero_std": lambda s: 0.75 + jitter(s, 0.1)}, 10),
    "filter_rounds_exhausted": ({"filter__fill": lambda s: 1.0 if s % 3 == 0 else 0.5}, 10),
    "reward_failures": ({"reward__failed_rate": lambda s: 0.2}, 1),
    "episodes_cut_by_budget": ({"env__ended_by__max_episode_tokens": lambda s: 0.8 + jitter(s, 0.1)}, 10),
    "tool_errors": ({"env__tool_calls": lambda s: 1.0, "env__tool_errors": lambda s: 0.9 + jitter(s, 0.05)}, 10),
}


def test_tool_errors_weighs_the_calls_of_the_window_and_stays_quiet_at_half_or_without_calls():
    _, raised = run_stream(10, env__tool_calls=lambda s: 2.0 if s % 2 else 0.0, env__tool_errors=lambda s: 1.5 if s % 2 else 0.0)
    assert [w.message for w in raised] == ["75% of the tool calls were answered with an error over the last 10 updates (above 0.5)"]
    assert run_stream(20, env__tool_calls=lambda s: 1.0, env__tool_errors=lambda s: 0.5)[1] == []
    assert run_stream(20, env__tool_calls=lambda s: 0.0, env__tool_errors=lambda s: 0.0)[1] == []


def test_every_rule_has_a_case():
    assert sorted(RULE_CASES) == sorted(rule.id for rule in RULES)


@pytest.mark.parametrize("rule_id", sorted(RULE_CASES))
def test_each_rule_fires_on_its_pattern_and_no_other_rule_does(rule_id):
    patterns, by_step = RULE_CASES[rule_id]
    monitor, raised = run_stream(40, **patterns)
    assert {w.rule for w in raised} == {rule_id}, [(w.rule, w.step, w.message) for w in raised]
    first = next(w for w in raised if w.rule == rule_id)
    assert first.step <= by_step and first.since == first.step
    assert first.message and first.cause and first.fix and math.isfinite(first.value) or rule_id == "value_loss_rising"


def test_groups_without_signal_names_the_fraction_and_stays_quiet_at_half():
    _, raised = run_stream(10, frac_reward_zero_std=lambda s: 0.8)
    assert [w.message for w in raised] == [
        "80% of the prompt groups scored all their completions the same over the last 10 updates (above 0.5)"]
    assert "generation.num_generations" in raised[0].fix and "generation.temperature" in raised[0].fix
    assert run_stream(40, frac_reward_zero_std=lambda s: 0.5)[1] == []  # half the groups still teach


def test_rule_is_quiet_before_its_window_is_full():
    monitor, raised = run_stream(9, policy__clipfrac_avg=lambda s: 0.9)
    assert raised == []
    monitor.observe({"policy/clipfrac_avg": 0.9}, 10)
    assert monitor.active == ["clipfrac_high"]


def test_kl_rising_from_zero_in_the_first_window_is_not_a_warning():
    # KL always grows from 0 at the start; only a rise that goes on after the first window counts.
    _, raised = run_stream(19, objective__kl=lambda s: 0.8 * s)
    assert raised == []


def test_kl_growing_mentions_a_zero_kl_coef():
    _, raised = run_stream(25, objective__kl=lambda s: 0.8 * s, objective__kl_coef=lambda s: 0.0)
    assert raised[0].rule == "kl_growing" and "ppo.kl_coef is 0" in raised[0].message


def test_kl_high_mentions_a_zero_kl_coef():
    _, raised = run_stream(10, objective__kl=lambda s: 60.0, objective__kl_coef=lambda s: 0.0)
    assert [w.rule for w in raised] == ["kl_high"] and raised[0].message.endswith("ppo.kl_coef is 0")


def test_clipfrac_low_is_quiet_while_the_reward_still_rises():
    _, raised = run_stream(40, policy__clipfrac_avg=lambda s: 0.01, objective__scores=lambda s: 0.2 * s)
    assert raised == []


def test_reward_rising_with_stable_diversity_is_not_reward_hacking():
    _, raised = run_stream(40, objective__scores=lambda s: 0.3 * s + jitter(s))
    assert raised == []


def test_non_finite_value_loss_fires_at_once():
    _, raised = run_stream(3, loss__value_avg=lambda s: float("nan") if s == 3 else 1.0)
    assert [(w.rule, w.step) for w in raised] == [("value_loss_rising", 3)]
    assert "nan" in raised[0].message


def test_warning_is_returned_when_it_starts_then_every_repeat_every_updates():
    config = MonitorConfig(repeat_every=20)
    monitor, raised = run_stream(50, config, policy__clipfrac_avg=lambda s: 0.7)
    assert [(w.step, w.since) for w in raised] == [(10, 10), (30, 10), (50, 10)]
    assert monitor.active == ["clipfrac_high"]


def test_warning_clears_when_the_pattern_ends_and_a_flicker_is_not_reprinted_early():
    flicker = lambda s: 0.9 if s <= 12 or 16 <= s <= 40 else 0.0  # noqa: E731
    monitor, raised = run_stream(40, MonitorConfig(window=3, repeat_every=20), policy__clipfrac_avg=flicker)
    # window means: active 3-13 (0.6 at 13), clear 14-16, active again from 17 (0.6); not shown before 3 + 20
    assert [(w.step, w.since) for w in raised if w.rule == "clipfrac_high"] == [(3, 3), (23, 17)]
    summary = next(row for row in monitor.summary() if row["rule"] == "clipfrac_high")
    assert summary["first_step"] == 3 and summary["last_step"] == 40 and summary["active_at_end"]


def test_health_warnings_list_follows_the_active_rules():
    monitor = HealthMonitor(MonitorConfig(window=2))
    active = []
    for step, eos in enumerate([0.0, 0.0, 0.0, 0.5, 0.5], start=1):
        monitor.observe({"eos_rate": eos}, step)
        active.append(list(monitor.active))
    assert active == [[], ["eos_stuck"], ["eos_stuck"], [], []]


def test_thresholds_come_from_the_config():
    _, default = run_stream(30, policy__clipfrac_avg=lambda s: 0.4)
    _, strict = run_stream(30, MonitorConfig(clipfrac_high=0.3), policy__clipfrac_avg=lambda s: 0.4)
    assert default == [] and {w.rule for w in strict} == {"clipfrac_high"}


def test_disabled_monitor_is_silent():
    monitor, raised = run_stream(40, MonitorConfig(enabled=False), eos_rate=lambda s: 0.0)
    assert raised == [] and monitor.active == []


def test_missing_and_non_numeric_metrics_are_ignored():
    monitor = HealthMonitor()
    for step in range(1, 50):
        assert monitor.observe({"step": step, "eos_rate": None, "policy/clipfrac_avg": "inf", "x": [1]}, step) == []


def test_summary_lists_each_rule_once_in_the_order_they_fired():
    monitor, _ = run_stream(40, eos_rate=lambda s: 0.0, val__ratio_first_minibatch=lambda s: 1.5)
    rows = monitor.summary()
    assert [r["rule"] for r in rows] == ["ratio_mismatch", "eos_stuck"]
    assert rows[0]["first_step"] == 3 and rows[0]["updates"] == 38 and rows[1]["first_step"] == 10
    assert set(rows[0]) == {"rule", "message", "cause", "fix", "value", "first_step", "last_step", "updates", "active_at_end"}


@pytest.mark.parametrize("values, tau", [([1, 2, 3, 4], 1.0), ([4, 3, 2, 1], -1.0), ([1, 1, 1], 0.0), ([1, 3, 2], 1 / 3), ([5], 0.0)])
def test_kendall_tau_hand_computed(values, tau):
    assert kendall_tau(values) == pytest.approx(tau)


# --- the advice names real recipe keys --------------------------------------------------------------

SECTIONS = "|".join(Recipe.model_fields)


def _resolves(path: list[str]) -> bool:
    tp = Recipe
    for part in path:
        while typing.get_origin(tp) is not None and not (isinstance(tp, type) and issubclass(tp, BaseModel)):
            tp = next((a for a in typing.get_args(tp) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if tp is None or part not in tp.model_fields:
            return False
        tp = tp.model_fields[part].annotation
    return True


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.id)
def test_every_recipe_key_a_rule_names_exists(rule):
    keys = re.findall(rf"\b(?:{SECTIONS})(?:\.[a-z_]+)+", rule.fix + " " + rule.cause)
    assert keys, f"{rule.id}: the fix should name the recipe key to change"
    for key in keys:
        assert _resolves(key.split(".")), f"{rule.id} names {key}, which is not a recipe key"


def test_reward_failures_warn_at_the_first_update_with_a_failed_reward():
    from ppo_cli.monitor import HealthMonitor

    monitor = HealthMonitor(MonitorConfig())
    assert monitor.observe({"reward/failed_rate": 0.0}, 1) == []
    (warning,) = [w for w in monitor.observe({"reward/failed_rate": 0.25}, 2) if w.rule == "reward_failures"]
    assert warning.message == "25% of the completions got no reward at the last update (above 0)"
    assert HealthMonitor(MonitorConfig(reward_failed_high=0.3)).observe({"reward/failed_rate": 0.25}, 1) == []


def test_filter_rounds_exhausted_counts_the_short_updates():
    config = MonitorConfig(window=4)
    # 2 of 4 updates short: at the threshold 0.5, quiet; 3 of 4: fires, with the numbers
    _, raised = run_stream(4, config, filter__fill=lambda s: 1.0 if s % 2 else 0.25)
    assert [w.rule for w in raised] == []
    _, raised = run_stream(4, config, filter__fill=lambda s: 1.0 if s == 1 else 0.5)
    [warning] = [w for w in raised if w.rule == "filter_rounds_exhausted"]
    assert warning.value == 0.75
    assert warning.message == ("75% of the last 4 updates ran out of filter rounds with the batch short "
                               "(62% full on average; above 0.5)")
