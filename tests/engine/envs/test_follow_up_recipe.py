"""recipes/smollm2_follow_up.yaml's pieces without a model: the simulated user's two steps and the
reward on hand-made transcripts (the numbers worked out by hand from the docstring's rule)."""

from __future__ import annotations

import pytest

from tests.conftest import ROOT


def _load(name: str):
    from ppo_cli.engine.rewards.function import load_reward_function

    return load_reward_function(f"{ROOT}/{name}")


def _transcript(first: str, request: str | None, last: str | None) -> list[dict]:
    messages = [{"role": "assistant", "content": first}]
    if request is not None:
        messages += [{"role": "user", "content": request}, {"role": "assistant", "content": last}]
    return messages


def test_the_follow_up_reward_grades_the_last_answer_by_words_after_the_request():
    follow_up = _load("recipes/rewards/follow_up.py:follow_up")
    words = lambda n: " ".join(["word"] * n)  # noqa: E731
    ask = "Now say that in five words or fewer."
    cases = [
        (_transcript(words(30), None, None), 0.0),        # first answer cut: the follow-up never came
        (_transcript("Paris.", None, None), 0.0),         # one short answer is still not the follow-up
        (_transcript("The capital is Paris.", ask, "Paris."), 1.0),
        (_transcript(words(12), ask, words(5)), 1.0),     # 5 words: honoured
        (_transcript(words(12), ask, words(6)), 1 - 1 / 15),
        (_transcript(words(12), ask, words(11)), 1 - 6 / 15),  # 0.6
        (_transcript(words(12), ask, words(20)), 0.0),
        (_transcript(words(12), ask, words(31)), 0.0),    # never below 0 for a long answer
        (_transcript(words(12), ask, ""), -1.0),          # saying nothing never wins
    ]
    messages = [m for m, _ in cases]
    responses = [m[-1]["content"] for m in messages]
    assert follow_up(["Q?"] * len(cases), responses, messages) == pytest.approx([s for _, s in cases])


def test_the_simulated_user_asks_one_follow_up_picked_by_the_seed_then_ends_the_episode():
    from ppo_cli.engine.user_code import import_named
    from ppo_cli.errors import EnvironmentSetupError

    follow_up_user = import_named(f"{ROOT}/recipes/envs/follow_up.py:FollowUp", "environment class", EnvironmentSetupError)
    requests = import_named(f"{ROOT}/recipes/envs/follow_up.py:REQUESTS", "requests", EnvironmentSetupError)
    user = follow_up_user()
    assert user.reset({"prompt": "Q?"}, seed=4) is None  # the prompt is the first user message
    first = user.step({"role": "assistant", "content": "The capital of France is Paris."})
    assert first == {"observation": requests[1], "reward": 0.0, "done": False}  # seed 4, 3 phrasings: 4 % 3 = 1
    assert user.step({"role": "assistant", "content": "Paris."}) == {"observation": None, "reward": 0.0, "done": True}
    user.reset({}, seed=3)  # a new episode starts over, with the seed's phrasing
    assert user.step({"role": "assistant", "content": "x"})["observation"] == requests[0]


def test_the_follow_up_recipe_loads_with_its_python_environment():
    from ppo_cli.recipe_loading import load_recipe

    recipe = load_recipe(ROOT / "recipes/smollm2_follow_up.yaml")
    environment = recipe.environment
    assert (environment.type, environment.class_, environment.max_turns) == ("python", "recipes/envs/follow_up.py:FollowUp", 2)
    assert (recipe.ppo.advantage, recipe.generation.max_new_tokens, recipe.generation.num_generations) == ("grpo", 40, 4)
