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
