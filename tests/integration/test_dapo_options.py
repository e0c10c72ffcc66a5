"""DAPO's dynamic sampling and overlong shaping, and TRL's top_entropy_quantile, on the tiny GRPO recipe:
updates run, each option's metrics are logged, and the groups kept are the ones an independent count keeps."""

import json

import pytest
import torch
from typer.testing import CliRunner

from ppo_cli import metric_names as names
from ppo_cli.cli import app
from ppo_cli.engine.engine import load_engine
from ppo_cli.recipe_loading import load_recipe
from ppo_cli.train_setup import init_state
from ppo_cli.trainer import train_step
from tests.conftest import ROOT, tiny_overrides
from tests.integration.test_critic_free import RECIPE, _sets

pytestmark = pytest.mark.slow

PROMPTS, G, EXTRA_ROUNDS = 4, 4, 2
SMALL = {"data.eval_prompts": ROOT / "recipes/prompts/reviews_eval.txt", "ppo.rollout_batch_size": PROMPTS, "ppo.mini_batch_size": 8,
         "ppo.micro_batch_size": 8, "generation.max_new_tokens": 12}
# A 0/1 reward that often scores a whole group alike (p = 1/5 per completion: 41% of groups of 4).
ZERO_ONE = "def reward(prompts, responses):\n    return [float(len(r) % 5 == 0) for r in responses]\n"


def test_filter_groups_keeps_the_groups_that_scored_apart(tiny_models, tmp_path):
    (tmp_path / "zero_one.py").write_text(ZERO_ONE)
    sets = {**SMALL, "ppo.filter_groups": "true", "ppo.max_filter_rounds": EXTRA_ROUNDS,
            "ppo.top_entropy_quantile": 0.2, "reward.missing_eos_penalty": "null",
            "reward.components": f"[{{type: function, function: '{tmp_path / 'zero_one.py'}:reward'}}]"}
    recipe = load_recipe(RECIPE, tiny_overrides(tiny_models, tmp_path, **sets))
    torch.manual_seed(0)
    engine = load_engine(recipe)
    rounds_scores, collect = [], engine.collect_rollout

    def recording(prompts, old_logprobs=True):
        rollout = collect(prompts, old_logprobs=old_logprobs)
        rounds_scores.append((prompts, rollout.scores.view(-1, G)))
        return rollout

    engine.collect_rollout = recording
    state = init_state(engine, [line.strip() for line in open(recipe.data.prompts) if line.strip()])
    rounds_run = []
    for _ in range(3):
        rounds_scores.clear()
        metrics, rollout = train_step(state)
        # the independent count: each round's groups whose scores are not all equal, in order, up to PROMPTS
        expected = [prompts[g * G] for prompts, scores in rounds_scores for g in range(PROMPTS)
                    if scores[g].max() > scores[g].min()][:PROMPTS]
        assert metrics[names.FILTER_ROUNDS] == len(rounds_scores) <= 1 + EXTRA_ROUNDS
        assert metrics[names.FILTER_GENERATED_EPISODES] == len(rounds_scores) * PROMPTS * G
        assert metrics[names.FILTER_KEPT_GROUPS] == len(expected)
        assert metrics[names.FILTER_FILL] == len(expected) / PROMPTS
        if expected:
            assert rollout.prompts == [p for p in expected for _ in range(G)]
            assert (rollout.scores.view(-1, G).amax(1) > rollout.scores.view(-1, G).amin(1)).all()
        rounds_run.append(len(rounds_scores))
        all_scores = torch.cat([scores.flatten() for _, scores in rounds_scores])
        assert metrics[names.OBJECTIVE_SCORES] == pytest.approx(all_scores.mean().item())  # dropped groups count
        assert metrics[names.POLICY_ENTROPY_THRESHOLD] > 0.0 and metrics[names.SKIPPED] == 0
    assert max(rounds_run) > 1, rounds_run  # the extra rounds ran (seeded: 41% of groups all alike)


def test_overlong_shaping_and_entropy_selection_through_the_cli(tiny_models, tmp_path):
    sets = {**SMALL, "train.total_updates": 2, "name": "dapo", "ppo.top_entropy_quantile": 0.2,
            "reward.overlong_buffer": 4, "reward.overlong_penalty": 2.0}
    result = CliRunner().invoke(app, ["train", str(RECIPE), *_sets(tiny_models, tmp_path, **sets)])
    assert result.exit_code == 0, result.output
    metrics = [json.loads(line) for line in (tmp_path / "dapo" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    for m in metrics:
        assert -2.0 <= m[names.REWARD_OVERLONG] <= 0.0
        assert m[names.POLICY_ENTROPY_THRESHOLD] > 0.0


def test_filter_groups_resumes_exactly(tiny_models, tmp_path):
    """The extra rounds move the prompt sampler further: a run stopped after update 2 and resumed to 4
    gives the uninterrupted run's metrics (the sampler's position and the RNG are in the checkpoint)."""
    from tests.integration.test_reliability import _assert_same_metrics

    (tmp_path / "zero_one.py").write_text(ZERO_ONE)
    sets = {**SMALL, "ppo.filter_groups": "true", "ppo.max_filter_rounds": EXTRA_ROUNDS, "train.save_every": 2,
            "reward.missing_eos_penalty": "null",
            "reward.components": f"[{{type: function, function: '{tmp_path / 'zero_one.py'}:reward'}}]"}

    def train(out, updates, *flags):
        args = [a for item in tiny_overrides(tiny_models, out, **sets, **{"train.total_updates": updates})
                for a in ("--set", item)]
        result = CliRunner().invoke(app, ["train", str(RECIPE), *args, *flags])
        assert result.exit_code == 0, result.output
        return [json.loads(line) for line in (out / "tiny-grpo" / "metrics.jsonl").read_text().splitlines()]

    reference = train(tmp_path / "reference", 4)
    train(tmp_path / "stopped", 2)
    resumed = train(tmp_path / "stopped", 4, "--resume", "latest")
    assert any(m[names.FILTER_ROUNDS] > 1 for m in reference)
    _assert_same_metrics(resumed, reference)


def test_two_processes_agree_on_the_filtered_batch(tiny_models, tmp_path):
    """`--num-processes 2` (gloo): every process runs the same rounds and trains on the same number of groups
    (its own, whole), so the run neither hangs nor splits; the counts in the metrics are global."""
    import os
    import subprocess
    import sys

    (tmp_path / "zero_one.py").write_text(ZERO_ONE)
    sets = {**SMALL, "ppo.filter_groups": "true", "ppo.max_filter_rounds": EXTRA_ROUNDS, "train.total_updates": 3,
            "ppo.top_entropy_quantile": 0.5, "reward.missing_eos_penalty": "null",
            "data.eval_prompts": ROOT / "recipes/prompts/reviews_eval.txt",  # evaluated on both processes, as a user's run is
            "reward.components": f"[{{type: function, function: '{tmp_path / 'zero_one.py'}:reward'}}]"}
    args = [sys.executable, "-m", "ppo_cli", "train", str(RECIPE), "--num-processes", "2",
            *[a for item in tiny_overrides(tiny_models, tmp_path, **sets) for a in ("--set", item)]]
    result = subprocess.run(args, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    evaluation = json.loads((tmp_path / "tiny-grpo" / "eval.json").read_text())
    assert len(evaluation["before"]["samples"]) == len(evaluation["after"]["samples"]) == 16  # every held-out prompt, once
    metrics = [json.loads(line) for line in (tmp_path / "tiny-grpo" / "metrics.jsonl").read_text().splitlines()]
    episodes = 0
    for m in metrics:
        kept, rounds = m[names.FILTER_KEPT_GROUPS], m[names.FILTER_ROUNDS]
        assert kept % 2 == 0 and kept <= 2 * PROMPTS  # the same number of groups on each process
        assert m[names.FILTER_FILL] == kept / 2 / PROMPTS
        assert m[names.FILTER_GENERATED_EPISODES] == rounds * PROMPTS * G * 2
        episodes += (kept or 2 * PROMPTS) * G
        assert m[names.EPISODE] == episodes
    assert any(m[names.FILTER_ROUNDS] > 1 for m in metrics)  # the processes went on to more rounds together
