"""The columns a reward function takes: read from its source (validate, not run) as from the imported function."""

from __future__ import annotations

import pytest

from ppo_cli.engine.rewards.function_columns import (declared_columns, declared_positional, per_row_error,
                                                     positional_parameters, required_columns)
from ppo_cli.engine.user_code import import_named
from ppo_cli.errors import RewardFunctionError
from tests.conftest import ROOT

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


@pytest.mark.parametrize("signature, expected", [
    ("(prompts, responses, solution)", ["prompts", "responses", "solution"]),
    ("(prompts, /, responses, *, solution)", ["prompts", "responses"]),
    ("(*args, **kwargs)", []),
    ("(data_source, solution_str, ground_truth, extra_info=None)", ["data_source", "solution_str", "ground_truth", "extra_info"]),
])
def test_declared_positional_parameters_read_from_the_source_match_the_imported_functions(tmp_path, signature, expected):
    path = tmp_path / "reward.py"
    path.write_text(f"def reward{signature}:\n    return []\n")
    assert declared_positional(path, "reward") == expected
    assert positional_parameters(import_named(f"{path}:reward", "reward function", RewardFunctionError)) == expected


BATCHED = "ppo calls reward functions batched, f(prompts, responses, **columns) -> list"
VERL = ["data_source", "solution_str", "ground_truth", "extra_info"]


def test_verls_per_row_compute_score_is_refused_with_a_wrapper_for_the_rows_ground_truth():
    err = per_row_error("rewards.py:compute_score", VERL, {"data_source", "ground_truth"})
    assert err.message == (
        "reward function 'rewards.py:compute_score' names its parameters data_source and solution_str as verl's per-row "
        f"compute_score(data_source, solution_str, ground_truth, extra_info) does: {BATCHED}, so data_source would get "
        "the list of prompts and solution_str the list of responses")
    assert err.hint.splitlines() == [
        "add this wrapper to rewards.py and name it in the recipe (function: rewards.py:compute_score_batched):",
        "    def compute_score_batched(prompts, responses, ground_truth, data_source=None, extra_info=None):",
        "        rows = zip(data_source or [None] * len(responses), responses, ground_truth, extra_info or [None] * len(responses))",
        "        return [compute_score(d, r, g, e) for d, r, g, e in rows]",
    ]
    # verl's parquet layout: the ground truth inside the reward_model struct
    err = per_row_error("rewards.py:compute_score", VERL, {"data_source", "reward_model", "extra_info"})
    assert err.hint.splitlines()[1:] == [
        "    def compute_score_batched(prompts, responses, reward_model, data_source=None, extra_info=None):",
        "        rows = zip(data_source or [None] * len(responses), responses, reward_model, extra_info or [None] * len(responses))",
        "        return [compute_score(d, r, g[\"ground_truth\"], e) for d, r, g, e in rows]",
    ]


def test_the_wrapper_in_the_hint_scores_each_row_with_the_per_row_function():
    namespace = {"compute_score": lambda d, r, g, e: float(r.strip() == g and d == "gsm8k" and e is None)}
    hint = per_row_error("rewards.py:compute_score", VERL, {"data_source", "reward_model"}).hint
    exec("\n".join(line[4:] for line in hint.splitlines()[1:]), namespace)
    truths = [{"style": "rule", "ground_truth": "4"}, {"style": "rule", "ground_truth": "9"}]
    assert namespace["compute_score_batched"](["2+2?", "3*3?"], [" 4", "8"], truths, ["gsm8k", "gsm8k"]) == [1.0, 0.0]


def test_the_wrapper_in_docs_rewards_md_is_the_one_the_hint_prints():
    hint = per_row_error("my_verl_reward.py:compute_score", VERL, {"reward_model"}).hint
    docs = (ROOT / "docs" / "rewards.md").read_text()
    assert all(line[4:] in docs for line in hint.splitlines()[1:])
    assert "(function: my_verl_reward.py:compute_score_batched)" in hint and "`function: my_verl_reward.py:compute_score_batched`" in docs


@pytest.mark.parametrize("positional, columns, named", [
    (["answer", "responses"], {"answer"}, "parameter answer like a column: {}, so answer would get the list of prompts"),
    (["prompts", "solution"], {"solution", "id"}, "parameter solution like a column: {}, so solution would get the list of responses"),
    (["ground_truth", "response"], set(), "parameter ground_truth like a column: {}, so ground_truth would get the list of prompts"),
])
def test_a_first_or_second_parameter_named_like_a_column_is_refused(positional, columns, named):
    err = per_row_error("r.py:score", positional, columns)
    assert err.message == f"reward function 'r.py:score' names its {named.format(BATCHED)}"
    listed = next(p for p in positional if p in columns or p == "ground_truth")
    assert err.hint == ("take the lists and return one value per response, in order: "
                        f"def score(prompts, responses, {listed}, **columns) -> list[float]")


@pytest.mark.parametrize("positional", [["prompts", "responses", "ground_truth"], ["p", "r", "answer"], ["prompt", "response"], []])
def test_a_batched_function_is_not_refused_whatever_its_columns(positional):
    assert per_row_error("r.py:score", positional, {"ground_truth", "answer", "data_source"}) is None
