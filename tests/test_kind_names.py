"""The schema declares the names a recipe may use (value.kind, a reward component's type) without
importing the engine; each must be a class in the engine's registry, and every class a name."""

from typing import get_args

from ppo_cli.recipe import CRITIC_KINDS, RewardComponent, ValueConfig


def test_value_kinds_in_the_schema_are_the_critic_classes():
    from ppo_cli.engine.critics import CRITICS

    assert list(CRITIC_KINDS) == list(CRITICS)
    assert all(CRITICS[name].kind == name for name in CRITIC_KINDS)


def test_value_kind_accepts_auto_and_each_critic_kind():
    assert get_args(ValueConfig.model_fields["kind"].annotation) == ("auto", "adapter", "head", "model", "none")


def test_reward_types_in_the_schema_are_the_scorers_and_the_checks():
    from ppo_cli.engine.rewards import SCORERS
    from ppo_cli.reward_checks import CHECKS

    union = get_args(get_args(RewardComponent)[0])
    types = [get_args(cls.model_fields["type"].annotation)[0] for cls in union]
    assert sorted(types) == sorted(SCORERS) == sorted(CHECKS) == ["classifier", "function", "http", "judge", "model"]
