"""`ppo train`'s held-out evaluation samples with the settings `ppo eval` and `ppo compare` use by
default: same seed, same batches (the batch size changes the sampled responses)."""

from types import SimpleNamespace

import pytest

from ppo_cli import evaluation
from ppo_cli.commands.inputs import sampling_settings
from ppo_cli.errors import RewardServerError
from ppo_cli.evaluation import SamplingSettings, held_out
from ppo_cli.recipe_loading import load_recipe
from tests.conftest import ROOT

PROMPTS = [f"question {i}" for i in range(12)]


class Sampled(Exception):
    pass


@pytest.fixture
def settings_of_held_out(monkeypatch):
    """held_out's SamplingSettings for (recipe, seed, dist), caught where it samples."""
    def sample_rows(engine, model, prompts, settings, **_):
        raise Sampled(prompts, settings)

    monkeypatch.setattr(evaluation, "sample_rows", sample_rows)

    def run(recipe, seed, dist=None):
        with pytest.raises(Sampled) as caught:
            held_out(SimpleNamespace(recipe=recipe, reward=None), PROMPTS, seed, dist)
        return caught.value.args

    return run


def test_held_out_samples_in_the_batches_eval_and_compare_use(settings_of_held_out):
    recipe = load_recipe(ROOT / "recipes/smollm2_concise_grpo.yaml", [])
    prompts, settings = settings_of_held_out(recipe, recipe.seed)
    assert prompts == PROMPTS
    assert settings == sampling_settings(recipe, 1, None) == SamplingSettings(0, num_samples=1, batch_size=4)


def test_each_process_samples_its_share_with_seed_plus_rank_in_the_same_batches(settings_of_held_out):
    recipe = load_recipe(ROOT / "recipes/smollm2_concise_grpo.yaml", ["seed=7"])
    dist = SimpleNamespace(rank=1, world_size=2)
    prompts, settings = settings_of_held_out(recipe, recipe.seed, dist)
    assert prompts == PROMPTS[6:]
    assert settings == SamplingSettings(8, num_samples=1, batch_size=4)


@pytest.mark.parametrize("before", [True, False])
def test_no_held_out_reward_names_the_environment_when_every_episode_failed(monkeypatch, before):
    """An environment failing every held-out episode is named with its fix, not as a reward server's failure;
    before the first update the run keeps nothing, so the fix is to start again, not to resume."""
    failing = [{"prompt": p, "response": "", "env_failed": True, "env_failure": f"env.py:Game.reset raised KeyError: {i}"}
               for i, p in enumerate(PROMPTS[:2])]
    monkeypatch.setattr(evaluation, "sample_rows", lambda *a, **k: failing)
    monkeypatch.setattr(evaluation, "score_rows", lambda reward, rows, failures: [{**r, "reward": None} for r in rows])
    recipe = load_recipe(ROOT / "recipes" / "tiny_tools.yaml")
    with pytest.raises(RewardServerError) as err:
        held_out(SimpleNamespace(recipe=recipe, reward=None), PROMPTS[:2], 0, before=before)
    assert err.value.message == ("no held-out episode got a reward: every episode's environment failed: "
                                 "env.py:Game.reset raised KeyError: 0")
    assert err.value.hint == "fix the environment (ppo rollout writes each episode's env_failure), then " + (
        "run the same ppo train again (the run stopped before its first update, so nothing was kept)" if before
        else "continue with ppo train RECIPE --resume (the checkpoints written so far are intact)")


def test_no_held_out_reward_from_the_reward_says_so():
    rows = [{"prompt": "a", "reward": None, "env_failed": False}, {"prompt": "b", "reward": None}]
    err = evaluation.no_held_out_reward(rows, ["judge http://x: HTTP 500"], before=True)
    assert err.message == "no held-out prompt got a reward: judge http://x: HTTP 500"
    assert err.hint.startswith("check the reward (a server or judge that does not answer, functions that return None), "
                               "then run the same ppo train again")
