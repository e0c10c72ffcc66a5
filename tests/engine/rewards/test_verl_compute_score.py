"""recipes/rewards/verl_compute_score.py: verl's per-row compute_score behind ppo's batched call, on verl's parquet layout."""

from __future__ import annotations

import pytest

from ppo_cli.engine.data import read_prompts
from ppo_cli.engine.rewards.function import FunctionScorer, check_columns, load_reward_function
from ppo_cli.recipe import FunctionReward
from tests.conftest import ROOT

SPEC = f"{ROOT}/recipes/rewards/verl_compute_score.py"


@pytest.mark.parametrize("response, ground_truth, score", [
    ("She sells 16 - 3 - 4 = 9 eggs and makes 9 * 2 = $18.", "18", 1.0),  # the last number counts
    ("She makes 9 * 2 = 18 dollars, then 16 - 4 = 12", "18", 0.0),
    ("#### 1,000", "1000", 1.0),  # thousands commas
    ("The answer is 72.00.", "72", 1.0),  # the same number
    ("It is -3", "-3", 1.0),
    ("It is 3", "-3", 0.0),
    ("I do not know.", "5", 0.0),  # no number
    ("5", "five", 0.0),  # a ground truth that is no number matches nothing
])
def test_compute_score_matches_the_last_number_of_the_response(response, ground_truth, score):
    compute_score = load_reward_function(f"{SPEC}:compute_score")
    assert compute_score("openai/gsm8k", response, ground_truth) == score


def test_verl_score_calls_compute_score_per_row_and_skips_a_row_without_a_ground_truth():
    verl_score = load_reward_function(f"{SPEC}:verl_score")
    truths = [{"style": "rule", "ground_truth": "4"}, {"style": "rule", "ground_truth": "9"}, {"style": "rule", "ground_truth": None}]
    assert verl_score(["2+2?", "3*3?", "?"], ["4", "3 * 3 = 6", "7"], truths) == [1.0, 0.0, None]


def test_a_verl_parquet_gives_conversations_and_one_dict_per_row_to_the_batched_function(tmp_path):
    """The layout verl's examples/data_preprocess/gsm8k.py writes: prompt a list of messages, reward_model
    and extra_info structs. ppo reads the prompts as conversations and passes each struct as a dict per row."""
    import datasets

    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {a}+{b}?"}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(a + b)}, "extra_info": {"split": "train", "index": i}}
            for i, (a, b) in enumerate([(1, 1), (2, 3)])]
    path = tmp_path / "train.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    prompt_set = read_prompts(path)
    assert prompt_set.prompts == [row["prompt"] for row in rows]
    assert prompt_set.column_names == {"data_source", "ability", "reward_model", "extra_info"}
    component = FunctionReward(type="function", function=f"{SPEC}:verl_score")
    for import_functions in (False, True):  # validate reads the source, train imports it: nothing to refuse
        check_columns(component, [(str(path), prompt_set)], import_functions=import_functions)
    columns = {name: [row[name] for row in prompt_set.columns] for name in prompt_set.column_names}
    assert columns["reward_model"] == [{"style": "rule", "ground_truth": "2"}, {"style": "rule", "ground_truth": "5"}]
    scorer = FunctionScorer(component)
    assert scorer(prompt_set.prompts, ["1 + 1 = 2", "2 + 3 = 6"], columns) == [1.0, 0.0]
