"""commands/score.py: what a rollouts file must hold for the recipe's reward."""

from __future__ import annotations

import json

import pytest

from ppo_cli.commands.score import read_rollouts
from ppo_cli.errors import DataError
from ppo_cli.recipe_loading import load_recipe
from tests.conftest import ROOT, tiny_overrides


def test_the_overlong_penalty_needs_each_rows_response_tokens(tmp_path):
    rows = tmp_path / "rollouts.jsonl"
    rows.write_text(json.dumps({"prompt": "p", "response": "r", "finished": True}) + "\n")
    recipe = load_recipe(ROOT / "recipes" / "tiny_grpo.yaml", tiny_overrides(tmp_path, tmp_path))
    assert len(read_rollouts(rows, recipe)) == 1  # no length penalty: not needed
    shaped = load_recipe(ROOT / "recipes" / "tiny_grpo.yaml",
                         tiny_overrides(tmp_path, tmp_path, **{"reward.overlong_buffer": 4}))
    with pytest.raises(DataError) as err:
        read_rollouts(rows, shaped)
    assert err.value.message == f"{rows}:1: no 'response_tokens' field (fields: finished, prompt, response)"


def test_a_missing_rollouts_file_is_said_before_any_run_is_named(tmp_path, monkeypatch):
    """No 'recipe: runs/<the latest run>/recipe.yaml' line first: that run has nothing to do with the file."""
    from typer.testing import CliRunner

    from ppo_cli.cli import app

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["score", "nope.jsonl"])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == ["error: rollouts file not found: nope.jsonl",
                                          "hint: give a file written by `ppo rollout MODEL --out FILE`"]


@pytest.mark.parametrize("what, hint", [
    ("rollouts", "a rollouts file has one JSON object per line, as `ppo rollout` writes"),
    ("prompts", "each line of a .jsonl file must be one JSON object"),
])
def test_a_line_that_is_not_json_has_a_hint(tmp_path, what, hint):
    from ppo_cli.engine.data import read_recipe_prompts

    rows = tmp_path / "bad.jsonl"
    rows.write_text(json.dumps({"prompt": "p", "response": "r", "finished": True}) + "\n{\"prompt\": \n")
    recipe = load_recipe(ROOT / "recipes" / "tiny_grpo.yaml", tiny_overrides(tmp_path, tmp_path, **{"data.prompts": rows}))
    with pytest.raises(DataError) as err:
        read_rollouts(rows, recipe) if what == "rollouts" else read_recipe_prompts(recipe.data)
    assert (err.value.message, err.value.hint) == (f"{rows}:2: not valid JSON (Expecting value)", hint)


def test_the_help_says_what_score_and_train_do():
    from typer.testing import CliRunner

    from ppo_cli.cli import app

    def words(command: str) -> str:  # the help's text, its table's borders and line breaks left out
        return " ".join(CliRunner().invoke(app, [command, "--help"]).stdout.replace("│", " ").split())

    assert "--run <path> Run directory whose recipe.yaml gives the reward (without --recipe)." in words("score")
    assert "base/aligned" not in words("score") and "model's run" not in words("score")
    assert "(PPO, or GRPO, RLOO or REINFORCE++ by ppo.advantage)" in words("train")


def test_episodes_of_several_turns_show_their_steps_rewards_beside_the_components(tmp_path):
    """An episode's reward is its components' plus its steps' rewards: the summary names both parts, so that
    the mean reward is their sum (it was shown beside the components alone); a failed episode has none."""
    from ppo_cli.commands.score import STEP_REWARDS, run

    (tmp_path / "reward.py").write_text("def half(prompts, responses):\n    return [0.5 for _ in responses]\n")
    episode = {"prompt": [{"role": "user", "content": "guess"}], "response": "3", "finished": True,
               "response_tokens": 1, "messages": [], "turns": 2, "tool_calls": 0, "ended_by": "done"}
    rows = tmp_path / "rollouts.jsonl"
    rows.write_text("".join(json.dumps({**episode, **extra}) + "\n" for extra in (
        {"step_reward": 1.0, "env_failed": False}, {"step_reward": None, "env_failed": False},
        {"step_reward": None, "env_failed": True, "env_failure": "environment g.py:G.step raised KeyError: 'x'"})))
    recipe = load_recipe(ROOT / "recipes" / "tiny_grpo.yaml", tiny_overrides(tmp_path, tmp_path, **{
        "reward.components": f"[{{type: function, function: {tmp_path / 'reward.py'}:half}}]"}))
    result = run(recipe, rows, tmp_path / "scored.jsonl")
    assert result.components == {"half": 0.5, "missing_eos_penalty": 0.0, STEP_REWARDS: 0.5}
    assert result.mean_reward == pytest.approx(1.0)  # (1.5 + 0.5) / 2: the failed episode has no reward
    assert result.failed == 1
    assert result.failure == "environment g.py:G.step raised KeyError: 'x'"  # why that row has no reward


def test_rows_a_reward_function_left_without_a_reward_say_why_and_none_scored_is_one_line(tmp_path, capsys):
    from ppo_cli.commands.score import run
    from ppo_cli.errors import RewardServerError
    from ppo_cli.report import print_score

    (tmp_path / "reward.py").write_text("def picky(prompts, responses):\n    return [None if r == 'x' else 1.0 for r in responses]\n")
    recipe = load_recipe(ROOT / "recipes" / "tiny_grpo.yaml", tiny_overrides(tmp_path, tmp_path, **{
        "reward.components": f"[{{type: function, function: {tmp_path / 'reward.py'}:picky}}]"}))
    rows = tmp_path / "rollouts.jsonl"
    rows.write_text("".join(json.dumps({"prompt": "p", "response": r, "finished": True}) + "\n" for r in ("a", "x")))
    result = run(recipe, rows, tmp_path / "scored.jsonl")
    why = f"reward function '{tmp_path / 'reward.py'}:picky' returned None for 1 of 2 responses"
    assert (result.failed, result.failure) == (1, why)
    print_score(str(result.out), result.rows, result.mean_reward, result.components, result.failed, result.failure,
                covered=result.covered)
    printed = " ".join(capsys.readouterr().out.split())
    assert f"; 1 row without a reward (null: {why}); wrote" in printed
    assert "(picky +1.00 on 1 of 2 rows, missing_eos_penalty +0.00)" in printed  # its mean is over the row it scored

    rows.write_text(json.dumps({"prompt": "p", "response": "x", "finished": True}) + "\n")
    with pytest.raises(RewardServerError) as err:
        run(recipe, rows, tmp_path / "scored-none.jsonl")
    assert err.value.message == f"no row got a reward: reward function '{tmp_path / 'reward.py'}:picky' returned None for 1 of 1 responses"
    assert not (tmp_path / "scored-none.jsonl").exists()  # nothing half-written


def test_a_weighted_component_shows_its_weight_beside_its_mean(tmp_path, capsys):
    """The components' means are before their weights: 'used +0.75 x 0.2' adds up to the mean reward, '+0.75' alone did not."""
    from ppo_cli.commands.score import run
    from ppo_cli.report import print_score

    (tmp_path / "reward.py").write_text("def used(prompts, responses):\n    return [1.0 if 'x' in r else 0.0 for r in responses]\n"
                                        "def one(prompts, responses):\n    return [1.0] * len(responses)\n")
    recipe = load_recipe(ROOT / "recipes" / "tiny_grpo.yaml", tiny_overrides(tmp_path, tmp_path, **{
        "reward.components": f"[{{type: function, function: {tmp_path / 'reward.py'}:used, weight: 0.2}}, "
                             f"{{type: function, function: {tmp_path / 'reward.py'}:one}}]", "reward.missing_eos_penalty": "null"}))
    rows = tmp_path / "rollouts.jsonl"
    rows.write_text("".join(json.dumps({"prompt": "p", "response": r, "finished": True}) + "\n" for r in ("x", "x", "x", "a")))
    result = run(recipe, rows, tmp_path / "scored.jsonl")
    assert result.components == {"used": 0.75, "one": 1.0} and result.weights == {"used": 0.2}
    assert result.mean_reward == pytest.approx(0.2 * 0.75 + 1.0)
    print_score(str(result.out), result.rows, result.mean_reward, result.components, weights=result.weights)
    assert "mean reward +1.150 (used +0.75 x 0.2, one +1.00)" in " ".join(capsys.readouterr().out.split())
