"""The schema declares the names a recipe may use (value.kind, a reward component's type) without
importing the engine; each must be in the engine's registry (a critic class, a reward type's module),
and every registry entry a name."""

import inspect
import subprocess
import sys
from pathlib import Path
from typing import get_args

from ppo_cli.recipe import CRITIC_KINDS, REWARD_TYPE_NAMES, RewardComponent, RewardConfig, ValueConfig


def test_value_kinds_in_the_schema_are_the_critic_classes():
    from ppo_cli.engine.critics import CRITICS

    assert list(CRITIC_KINDS) == list(CRITICS)
    assert all(CRITICS[name].kind == name for name in CRITIC_KINDS)


def test_value_kind_accepts_auto_and_each_critic_kind():
    assert get_args(ValueConfig.model_fields["kind"].annotation) == ("auto", "adapter", "head", "model", "none")


def test_reward_types_in_the_schema_are_the_registry():
    from ppo_cli.engine.rewards.registry import REWARD_TYPES

    union = get_args(get_args(RewardComponent)[0])
    types = [get_args(cls.model_fields["type"].annotation)[0] for cls in union]
    assert sorted(types) == sorted(REWARD_TYPES) == ["classifier", "function", "http", "judge", "model"]
    assert REWARD_TYPE_NAMES == tuple(types)
    assert RewardConfig.model_fields["components"].description.startswith(
        "Reward components (type: model | classifier | function | http | judge);")


def test_each_reward_type_module_has_a_scorer_a_check_and_a_name():
    from ppo_cli.engine.rewards.registry import REWARD_TYPES

    for name, module in REWARD_TYPES.items():
        assert isinstance(module.Scorer, type), name
        assert list(inspect.signature(module.check).parameters) == ["component", "contact_servers", "import_functions"], name
        assert list(inspect.signature(module.display_name).parameters) == ["component"], name


def test_importing_the_reward_registry_and_its_checks_imports_no_torch():
    """`ppo validate` runs every type's check: the registry must not pull in torch or transformers."""
    code = ("import sys, ppo_cli.engine.rewards.checks, ppo_cli.commands.validate; "
            "assert not {'torch', 'transformers'} & set(sys.modules), 'torch or transformers imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_advantage_names_in_the_schema_are_the_estimator_registry():
    from ppo_cli.algo.estimators import ESTIMATORS
    from ppo_cli.recipe import CRITIC_FREE, PPOConfig

    names = get_args(PPOConfig.model_fields["advantage"].annotation)
    assert list(names) == list(ESTIMATORS)
    assert set(CRITIC_FREE) == set(ESTIMATORS) - {"gae"}  # every estimator but gae runs without values
