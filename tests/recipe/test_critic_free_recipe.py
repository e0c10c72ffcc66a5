"""ppo.advantage's critic-free estimators in the schema: the critic they resolve to, the batch sizes
they count in episodes, and each refusal as one exact line."""

from __future__ import annotations

from pathlib import Path

from ppo_cli.auto import value_kind
from ppo_cli.recipe_loading import dump_resolved, load_recipe
from tests.recipe.test_recipe import BASE, error, variant, write

GRPO = ["ppo.advantage=grpo", "generation.num_generations=4"]


def test_critic_free_estimators_resolve_auto_to_no_critic(tmp_path):
    path = write(tmp_path, BASE)
    assert value_kind(load_recipe(path)) == "head"  # gae keeps its critic
    for advantage in ("grpo", "rloo", "reinforce_pp"):
        recipe = load_recipe(path, [f"ppo.advantage={advantage}", "generation.num_generations=4"])
        assert value_kind(recipe) == "none"
    assert value_kind(load_recipe(path, ["ppo.advantage=grpo", "generation.num_generations=2", "value.kind=none"])) == "none"


def test_kl_penalty_auto_is_the_loss_for_grpo_only(tmp_path):
    path = write(tmp_path, BASE)
    assert load_recipe(path, GRPO).ppo.kl_in_loss
    assert not load_recipe(path, ["ppo.advantage=rloo", "generation.num_generations=4"]).ppo.kl_in_loss
    assert not load_recipe(path).ppo.kl_in_loss
    assert not load_recipe(path, [*GRPO, "ppo.kl_penalty=reward"]).ppo.kl_in_loss
    assert load_recipe(path, ["ppo.kl_penalty=loss"]).ppo.kl_in_loss


def test_mini_batches_count_episodes(tmp_path):
    recipe = load_recipe(write(tmp_path, BASE), ["ppo.advantage=grpo", "generation.num_generations=3"])
    assert recipe.episodes_per_update == 24  # 8 prompts x 3
    assert recipe.num_mini_batches == 6  # 24 / 4
    assert recipe.ppo.grad_accum_steps == 2


def test_group_estimators_refuse_one_completion_per_prompt(tmp_path):
    path = write(tmp_path, BASE)
    for advantage in ("grpo", "rloo"):
        err = error(path, [f"ppo.advantage={advantage}"])
        assert err.message == (f"--set ppo.advantage: '{advantage}' compares the completions of a prompt and needs "
                               "generation.num_generations >= 2, got 1")
        assert err.hint == "set `generation.num_generations: 4` (or more), or `ppo.advantage: reinforce_pp` or `gae`"
    load_recipe(path, ["ppo.advantage=reinforce_pp"])  # REINFORCE++ needs no group


def test_no_critic_with_gae_is_refused(tmp_path):
    err = error(variant(tmp_path, "data:\n", "value:\n  kind: none\ndata:\n"))
    assert err.message.endswith("recipe.yaml:11: value.kind: 'none' leaves ppo.advantage 'gae' without the values it needs")
    assert err.hint == "set `value.kind: auto` (a critic), or a critic-free `ppo.advantage`: grpo, rloo or reinforce_pp"


def test_a_critic_with_a_critic_free_estimator_is_refused(tmp_path):
    path = write(tmp_path, BASE)
    err = error(path, [*GRPO, "value.kind=head"])
    assert err.message == "--set value.kind: a 'head' critic would be trained for nothing: ppo.advantage 'grpo' uses no values"
    assert err.hint == "set `value.kind: none` (or auto) and remove the other value.* keys, or `ppo.advantage: gae`"
    err = error(path, [*GRPO, "value.train_backbone=true"])
    assert err.message == "--set value.train_backbone: configures a critic, but ppo.advantage 'grpo' has none"
    assert err.hint == "remove `value.train_backbone`, or set `ppo.advantage: gae`"


def test_episodes_that_do_not_divide_into_mini_batches(tmp_path):
    path = variant(tmp_path, "  rollout_batch_size: 8\n", "  rollout_batch_size: 3\n")
    err = error(path, GRPO[:1] + ["generation.num_generations=3"])
    assert err.message.endswith(
        "recipe.yaml:14: ppo.mini_batch_size: rollout_batch_size x generation.num_generations (3 x 3 = 9 episodes) must "
        "be a multiple of mini_batch_size (4): mini- and micro-batches count episodes (completions), not prompts "
        "(generation.num_generations from --set)")
    assert err.hint.endswith("mini_batch_size divides rollout_batch_size x num_generations")
    load_recipe(path, GRPO)  # 3 x 4 = 12 episodes: 3 mini-batches of 4


def test_scale_rewards_is_for_grpo_only(tmp_path):
    err = error(write(tmp_path, BASE), ["ppo.advantage=rloo", "generation.num_generations=4", "ppo.scale_rewards=none"])
    assert err.message == "--set ppo.scale_rewards: only used with ppo.advantage 'grpo', but it is 'rloo'"
    assert err.hint == "remove `ppo.scale_rewards` or set `ppo.advantage: grpo`"


def test_gae_only_keys_are_refused_with_a_critic_free_estimator(tmp_path):
    err = error(write(tmp_path, BASE), [*GRPO, "ppo.whiten_rewards=true"])
    assert err.message == "--set ppo.whiten_rewards: only used with ppo.advantage 'gae' (a critic), but it is 'grpo'"
    assert err.hint == "remove `ppo.whiten_rewards`, or set `ppo.advantage: gae`"


def test_a_resolved_critic_free_recipe_reads_back_equal(tmp_path):
    """The run's recipe.yaml writes every default (value.init_from, ppo.vf_coef, ...): it must load again."""
    recipe = load_recipe(write(tmp_path, BASE), [*GRPO, "ppo.scale_rewards=none"])
    assert load_recipe(write(tmp_path, dump_resolved(recipe), "resolved.yaml")) == recipe


def test_overlong_buffer_longer_than_the_responses_is_refused(tmp_path):
    path = write(tmp_path, BASE)
    err = error(path, ["reward.overlong_buffer=40", "generation.max_new_tokens=32"])
    assert err.message == ("--set reward.overlong_buffer: (40) is longer than generation.max_new_tokens (32): the "
                           "penalty would start before the first token")
    assert err.hint == "set `reward.overlong_buffer` to at most 32 (DAPO: a quarter of max_new_tokens)"
    assert load_recipe(path, ["reward.overlong_buffer=8", "generation.max_new_tokens=32"]).reward.overlong_buffer == 8


def test_filter_groups_is_refused_without_groups(tmp_path):
    path = write(tmp_path, BASE)
    err = error(path, ["ppo.filter_groups=true"])
    assert err.message == ("--set ppo.filter_groups: drops the groups whose completions all scored the same, and "
                           "ppo.advantage 'gae' has no groups (its critic gives such completions an advantage)")
    assert err.hint == "set `ppo.advantage: grpo` or `rloo` with `generation.num_generations: 4`, or remove `ppo.filter_groups`"
    err = error(path, ["ppo.filter_groups=true", "ppo.advantage=reinforce_pp"])
    assert err.message == ("--set ppo.filter_groups: compares the completions of a prompt and needs "
                           "generation.num_generations >= 2, got 1")
    assert err.hint == "set `generation.num_generations: 4` (or more), or remove `ppo.filter_groups`"
    err = error(path, [*GRPO, "ppo.max_filter_rounds=5"])
    assert err.message == "--set ppo.max_filter_rounds: has no effect without ppo.filter_groups"
    for advantage in ("grpo", "rloo", "reinforce_pp"):
        recipe = load_recipe(path, [f"ppo.advantage={advantage}", "generation.num_generations=4", "ppo.filter_groups=true",
                                    "ppo.max_filter_rounds=5"])
        assert recipe.ppo.filter_groups and recipe.ppo.max_filter_rounds == 5


def test_top_entropy_quantile_is_a_fraction(tmp_path):
    path = write(tmp_path, BASE)
    assert load_recipe(path, ["ppo.top_entropy_quantile=0.2"]).ppo.top_entropy_quantile == 0.2
    assert "ppo.top_entropy_quantile" in error(path, ["ppo.top_entropy_quantile=0"]).message
    assert "ppo.top_entropy_quantile" in error(path, ["ppo.top_entropy_quantile=1.5"]).message


def test_a_rule_located_in_the_file_names_the_field_that_came_from_set(monkeypatch):
    """The rule is keyed at a field of the file, but the value that broke it came from --set: the line
    says so instead of sending the user to a line that is fine."""
    import pytest

    from ppo_cli.errors import RecipeError
    from tests.conftest import ROOT

    monkeypatch.chdir(ROOT)
    with pytest.raises(RecipeError) as caught:
        load_recipe(Path("recipes/tiny_sentiment.yaml"), ["ppo.rollout_batch_size=3", "ppo.kl_coef=0.1"])
    assert caught.value.message == ("recipes/tiny_sentiment.yaml:50: ppo.mini_batch_size: rollout_batch_size (3) must "
                                    "be a multiple of mini_batch_size (16) (ppo.rollout_batch_size from --set)")
    with pytest.raises(RecipeError) as caught:  # across sections: the rule names generation.num_generations
        load_recipe(Path("recipes/tiny_grpo.yaml"), ["generation.num_generations=1"])
    assert caught.value.message.endswith("needs generation.num_generations >= 2, got 1 (generation.num_generations from --set)")
    assert caught.value.message.startswith("recipes/tiny_grpo.yaml:")
    with pytest.raises(RecipeError) as caught:  # 4 prompts x 1 no longer fill a mini-batch of 16: the group is named
        load_recipe(Path("recipes/tiny_grpo.yaml"), ["generation.num_generations=1", "ppo.rollout_batch_size=4"])
    assert "needs generation.num_generations >= 2, got 1" in caught.value.message
    with pytest.raises(RecipeError) as caught:  # the located field itself from --set: the line starts with it
        load_recipe(Path("recipes/tiny_sentiment.yaml"), ["ppo.mini_batch_size=3"])
    assert caught.value.message == "--set ppo.mini_batch_size: rollout_batch_size (64) must be a multiple of mini_batch_size (3)"
