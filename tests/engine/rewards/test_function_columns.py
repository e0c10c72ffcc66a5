"""The columns a reward function takes: read from its source (validate, not run) as from the imported function."""

from __future__ import annotations

import pytest

from ppo_cli.engine.rewards.function_columns import declared_columns, required_columns
from ppo_cli.engine.user_code import import_named
from ppo_cli.errors import RewardFunctionError

# (signature, the columns it cannot do without)
SIGNATURES = [
    ("(prompts, responses)", set()),
    ("(prompts, responses, solution)", {"solution"}),
    ("(p, r, solution, answer=None)", {"solution"}),  # a default: the column is optional
    ("(prompts, responses, *args, **kwargs)", set()),
    ("(prompts, responses, *, solution, answer='')", {"solution"}),
    ("(prompts, /, responses, solution)", {"solution"}),
    ("(prompts, responses=None, solution=None)", set()),
    # TRL's signature: everything by keyword, so every parameter but TRL's own names is a column
    ("(completions, solution, **kwargs)", {"solution"}),
    ("(prompts, completions, completion_ids, answer, hint=None, **kwargs)", {"answer"}),
    ("(completions, responses, **kwargs)", set()),
]


@pytest.mark.parametrize("signature, expected", SIGNATURES, ids=[s for s, _ in SIGNATURES])
def test_declared_columns_read_from_the_source_match_the_imported_functions(tmp_path, signature, expected):
    path = tmp_path / "reward.py"
    path.write_text(f"raise SystemExit('ran')\n\nasync def helper(): pass\n\ndef reward{signature}:\n    return []\n")
    assert declared_columns(path, "reward") == expected  # and the module's code did not run
    path.write_text(f"def reward{signature}:\n    return []\n")
    assert required_columns(import_named(f"{path}:reward", "reward function", RewardFunctionError)) == expected


@pytest.mark.parametrize("source", [
    "def reward(prompts, responses, solution): ...\nreward = make_reward()\n",  # rebound after the def
    "from helpers import reward\n",
    "import functools\n@functools.cache\ndef reward(prompts, responses, solution): ...\n",  # a decorator may change it
    "def other(prompts, responses, solution): ...\n",
    "def reward(prompts, responses:\n",
])
def test_declared_columns_are_unknown_where_the_source_does_not_say(tmp_path, source):
    path = tmp_path / "reward.py"
    path.write_text(source)
    assert declared_columns(path, "reward") is None


def test_declared_columns_take_the_last_definition_at_the_top_level(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text("reward = None\nreward.x = 1\n\ndef reward(prompts, responses, answer):\n    return []\n")
    assert declared_columns(path, "reward") == {"answer"}
