"""recipes/smollm2_follow_up.yaml on the real SmolLM2-135M-Instruct (the `smollm2` fixture): one update
of two-turn episodes with the simulated user, at a tiny batch. The reward's arithmetic is tested
without the model in tests/engine/envs/test_follow_up_recipe.py."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from ppo_cli.cli import app
from tests.conftest import ROOT

pytestmark = pytest.mark.slow
runner = CliRunner()
RECIPE = ROOT / "recipes" / "smollm2_follow_up.yaml"


def test_one_update_of_the_follow_up_recipe_runs_the_simulated_user(smollm2, tmp_path, monkeypatch):
    from ppo_cli.engine.user_code import import_named
    from ppo_cli.errors import EnvironmentSetupError
    from ppo_cli.engine.rewards.function import load_reward_function

    monkeypatch.chdir(ROOT)  # the recipe names its environment, reward and prompts relative to the repository
    sets = {"policy.path": str(smollm2), "output_dir": str(tmp_path), "name": "fu", "train.total_updates": 1,
            "ppo.rollout_batch_size": 2, "generation.num_generations": 2, "ppo.mini_batch_size": 4,
            "ppo.micro_batch_size": 4, "ppo.ppo_epochs": 1, "train.sample_every": 1, "train.num_threads": 1,
            "data.eval_prompts": "null"}
    result = runner.invoke(app, ["train", str(RECIPE), *[x for k, v in sets.items() for x in ("--set", f"{k}={v}")]])
    assert result.exit_code == 0, result.output
    run = tmp_path / "fu"
    row = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert row["skipped"] == 0 and row["env/failed_rate"] == 0.0
    assert 1.0 <= row["env/turns"] <= 2.0  # a first answer cut at 40 tokens ends its episode after one turn
    ended = sum(row[f"env/ended_by/{r}"] for r in ("done", "max_turns", "max_episode_tokens", "max_new_tokens"))
    assert ended == pytest.approx(1.0)
    # Every episode that got a second turn heard one of the user's follow-ups, and its sampled
    # transcript scores by the reward function as the run scored it (less the missing-EOS penalty).
    requests = import_named(f"{ROOT}/recipes/envs/follow_up.py:REQUESTS", "requests", EnvironmentSetupError)
    follow_up = load_reward_function(f"{ROOT}/recipes/rewards/follow_up.py:follow_up")
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples
    for sample in samples:
        messages = sample["messages"]
        assert messages[0]["role"] == "assistant" and sample["turns"] == sum(m["role"] == "assistant" for m in messages)
        if sample["turns"] == 2:
            assert messages[1] == {"role": "user", "content": messages[1]["content"]}
            assert messages[1]["content"] in requests
        penalty = 0.0 if sample["finished"] else 1.0  # the recipe's missing_eos_penalty, for a cut last answer
        assert sample["score"] == pytest.approx(follow_up(["q"], [messages[-1]["content"]], [messages])[0] - penalty)
