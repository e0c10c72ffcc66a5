"""Every metric name is declared once, in ppo_cli/metric_names.py, and the modules that write or read
metrics.jsonl go through it: no metric-shaped string literal is left in them, and each name a short
training run writes is a declared one (users' dashboards read these names: they never change)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import ppo_cli
from ppo_cli import metric_names
from ppo_cli.metric_names import memory_peak_gb, reward_component, reward_component_failed_rate

PACKAGE = Path(ppo_cli.__file__).parent
# The modules that write metrics.jsonl's lines or read them.
METRIC_MODULES = ("trainer.py", "train_metrics.py", "train_checks.py", "monitor.py", "report.py", "plots.py",
                  "observe.py", "model_card.py", "tracking.py", "resume.py", "evaluation.py", "commands/train.py",
                  "engine/envs/metrics.py")
# "objective/kl", "memory/", "reward/failed_rate/": lower-case words joined by '/' (no spaces: not prose)
METRIC_SHAPE = re.compile(r"[a-z][a-z0-9_]+/[a-z0-9_/]*")  # "n/a" is not one


def declared_constants() -> dict[str, str]:
    """The metric constants (metrics.jsonl names), the held-out summary's keys left out."""
    return {name: value for name, value in vars(metric_names).items()
            if name.isupper() and isinstance(value, str) and not name.startswith("HELD_OUT_")}


def metric_shaped_literals(source: str) -> list[tuple[int, str]]:
    """(line, text) of each string literal, or f-string's leading text, shaped like a metric name."""
    found, parts = [], set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            parts.update(id(value) for value in node.values)  # its text parts are not literals of their own
            text = node.values[0].value
            if isinstance(text, str) and METRIC_SHAPE.fullmatch(text):
                found.append((node.lineno, text))
        elif (isinstance(node, ast.Constant) and id(node) not in parts and isinstance(node.value, str)
              and METRIC_SHAPE.fullmatch(node.value)):
            found.append((node.lineno, node.value))
    return sorted(found)


def test_each_constant_is_its_metric_name_upper_cased_with_slashes_as_underscores():
    constants = declared_constants()
    assert len(constants) > 40 and "OBJECTIVE_KL" in constants
    assert {name: value for name, value in constants.items() if value.upper().replace("/", "_") != name} == {}
    assert len(set(constants.values())) == len(constants)  # no name declared twice


def test_the_families_with_a_variable_part_build_the_names_metrics_jsonl_has_always_had():
    assert reward_component("classifier:reward") == "reward/classifier:reward"
    assert reward_component("missing_eos_penalty") == "reward/missing_eos_penalty"
    assert reward_component_failed_rate("judge") == "reward/failed_rate/judge"
    assert memory_peak_gb("rollout") == "memory/rollout_peak_gb"
    assert memory_peak_gb("update") == "memory/update_peak_gb"


def test_the_names_the_monitor_progress_line_and_plots_read_are_declared():
    from ppo_cli.monitor import WATCHED
    from ppo_cli.plots import PANELS
    from ppo_cli.report import KEY_METRICS

    plotted = [metric for _, _, metrics, options in PANELS for metric, _ in metrics + [options.get("twin", ("step", ""))]]
    declared = set(declared_constants().values())
    assert {name for name in [*WATCHED, *(key for key, _, _ in KEY_METRICS), *plotted] if name not in declared} == set()


@pytest.mark.parametrize("module", METRIC_MODULES)
def test_no_metric_name_is_spelled_out_in_a_module_that_writes_or_reads_metrics(module):
    assert metric_shaped_literals((PACKAGE / module).read_text(encoding="utf-8")) == []


def test_the_literal_check_sees_names_plain_and_in_f_strings_and_not_prose():
    source = ('"""Sums over objective/* tokens."""\n'
              'a = {"objective/kl": 1, "eos_rate": 2}\n'
              'b = f"reward/{name}"\n'
              'c = "see reward/failed_rate/NAME in metrics.jsonl"\n')
    assert metric_shaped_literals(source) == [(2, "objective/kl"), (3, "reward/")]


# --- what a short run writes -----------------------------------------------------------------------

SMALL = {"ppo.rollout_batch_size": 2, "ppo.mini_batch_size": 2, "ppo.micro_batch_size": 2,
         "generation.max_new_tokens": 4}  # held-out evaluation left on (the default): its run writes names too


def _one_update(recipe_name: str, overrides: list[str]):
    import torch

    from ppo_cli.engine.engine import load_engine
    from ppo_cli.recipe_loading import load_recipe
    from ppo_cli.train_setup import init_state
    from ppo_cli.trainer import train_step
    from tests.conftest import ROOT

    recipe = load_recipe(ROOT / "recipes" / recipe_name, overrides)
    torch.manual_seed(0)
    engine = load_engine(recipe)
    return train_step(init_state(engine, ["The movie was", "I think the book was"]))


@pytest.mark.slow
@pytest.mark.parametrize("recipe_name, extra", [
    ("tiny_sentiment.yaml", {}),  # a critic: val/*, loss/value_avg, value_lr
    ("tiny_grpo.yaml", {"generation.num_generations": 2, "ppo.mini_batch_size": 4}),  # groups, loss/kl_avg
    ("tiny_grpo.yaml", {"generation.num_generations": 2, "ppo.mini_batch_size": 4, "ppo.filter_groups": "true",
                        "ppo.top_entropy_quantile": 0.5, "reward.overlong_buffer": 4}),  # filter/*, entropy threshold
])
def test_every_name_a_training_update_writes_is_declared(tiny_models, tmp_path, recipe_name, extra):
    from tests.conftest import tiny_overrides

    metrics, rollout = _one_update(recipe_name, tiny_overrides(tiny_models, tmp_path, **{**SMALL, **extra}))
    declared = set(declared_constants().values()) | {memory_peak_gb(phase) for phase in ("rollout", "update")}
    declared |= {reward_component(name) for name in rollout.score_components}
    assert {name for name in metrics if name not in declared} == set()
    assert metric_names.OBJECTIVE_KL in metrics and metric_names.POLICY_APPROXKL_AVG in metrics


@pytest.mark.slow
def test_a_reward_that_can_fail_writes_declared_failure_names(tiny_models, tmp_path):
    sets = {"policy.path": str(tiny_models / "policy"), "output_dir": str(tmp_path), **SMALL}
    metrics, rollout = _one_update("tiny_function_reward.yaml", [f"{k}={v}" for k, v in sets.items()])
    failable = list(rollout.reward_failures)
    assert failable  # a function may return None: its failures are counted
    declared = set(declared_constants().values()) | {memory_peak_gb(phase) for phase in ("rollout", "update")}
    declared |= {reward_component(name) for name in rollout.score_components}
    declared |= {reward_component_failed_rate(name) for name in failable}
    assert {name for name in metrics if name not in declared} == set()
    assert metric_names.REWARD_FAILED_RATE in metrics and reward_component_failed_rate(failable[0]) in metrics
