"""`ppo validate`'s source checks of tools and environment classes say what loading them at train says."""

from __future__ import annotations

import pytest

from ppo_cli.engine.envs.environments import EnvironmentFactory
from ppo_cli.engine.envs.source_checks import check_environment_class_source, check_tool_source
from ppo_cli.engine.envs.tools import load_tool
from ppo_cli.engine.user_code import last_binding
from ppo_cli.errors import EnvironmentSetupError
from ppo_cli.recipe import EnvironmentConfig

GOOD = '''
def convert(value: float, unit: str) -> str:
    """Convert a length.

    Args:
        value: the number
        unit (str): 'm' or 'ft'
    Returns:
        the converted length
    """
    return str(value)
'''

BAD_TOOLS = {
    "no docstring": "def convert(value: float) -> str:\n    return str(value)\n",
    "no type hint": 'def convert(value) -> str:\n    """Convert.\n\n    Args:\n        value: the number\n    """\n    return str(value)\n',
    "an argument not described": 'def convert(value: float, unit: str) -> str:\n    """Convert.\n\n    Args:\n        value: the number\n    """\n',
    "a constant": "convert = 42\n",
    "a class": "class convert:\n    pass\n",
}


@pytest.mark.parametrize("case", sorted(BAD_TOOLS))
def test_a_tool_validate_refuses_is_refused_by_train_in_the_same_words(tmp_path, case):
    path = tmp_path / "tools.py"
    path.write_text(BAD_TOOLS[case])
    spec = f"{path}:convert"
    with pytest.raises(EnvironmentSetupError) as from_source:
        check_tool_source(spec, last_binding(path, "convert"))
    with pytest.raises(EnvironmentSetupError) as from_import:
        load_tool(spec)
    assert (from_source.value.message, from_source.value.hint) == (from_import.value.message, from_import.value.hint)


def test_a_good_tool_and_what_the_source_cannot_tell_pass(tmp_path):
    path = tmp_path / "tools.py"
    path.write_text(GOOD + "from os.path import join\nimport functools\n@functools.lru_cache\ndef cached(x):\n    return x\n")
    for name in ("convert", "join", "cached"):
        check_tool_source(f"{path}:{name}", last_binding(path, name))
    assert load_tool(f"{path}:convert").schema["function"]["parameters"]["required"] == ["value", "unit"]


ENVIRONMENTS = {
    "Good": ("class Good:\n    def reset(self, row, seed):\n        return 'hi'\n    async def step(self, message):\n"
             "        return {'observation': None, 'reward': 0.0, 'done': True}\n", None),
    "Based": ("class Base:\n    def reset(self, row, seed): ...\n    def step(self, message): ...\nclass Based(Base):\n    pass\n", None),
    "Wrong": ("class Wrong:\n    def start(self, row, seed): ...\n    def act(self, message): ...\n", "not a class"),
    "Function": ("def Function(row, seed):\n    return 'hi'\n", "not a class"),
}


@pytest.mark.parametrize("name", sorted(ENVIRONMENTS))
def test_an_environment_class_without_reset_and_step_is_refused_as_train_refuses_it(tmp_path, name):
    source, refused = ENVIRONMENTS[name]
    path = tmp_path / "envs.py"
    path.write_text(source)
    spec = f"{path}:{name}"
    config = EnvironmentConfig.model_validate({"type": "python", "class": spec})
    if refused is None:
        check_environment_class_source(spec, last_binding(path, name))
        EnvironmentFactory(config)
        return
    with pytest.raises(EnvironmentSetupError) as from_source:
        check_environment_class_source(spec, last_binding(path, name))
    with pytest.raises(EnvironmentSetupError) as from_import:
        EnvironmentFactory(config)
    assert from_source.value.message == from_import.value.message == (
        f"environment class '{spec}' is not a class with reset and step")


@pytest.mark.parametrize("kwargs, message", [
    ({"low": 1, "high": 5}, None),
    ({"high": 5}, "environment class '{spec}' needs low in environment.kwargs (its __init__ has no default for it)"),
    ({"low": 1, "tries": 3}, "environment.kwargs gives tries, which environment class '{spec}' does not take "
                             "(its __init__ takes: low, high)"),
])
def test_environment_kwargs_are_checked_against_the_classs_own_init(tmp_path, kwargs, message):
    """What train's build of one environment would refuse (TypeError), from the source, before it runs."""
    path = tmp_path / "envs.py"
    path.write_text("class Game:\n    def __init__(self, low, high=10):\n        self.low, self.high = low, high\n"
                    "    def reset(self, row, seed): ...\n    def step(self, message): ...\n"
                    "class Plain:\n    def reset(self, row, seed): ...\n    def step(self, message): ...\n"
                    "class Open:\n    def __init__(self, **options): ...\n    def reset(self, row, seed): ...\n"
                    "    def step(self, message): ...\n")
    spec = f"{path}:Game"
    if message is None:
        check_environment_class_source(spec, last_binding(path, "Game"), kwargs)
    else:
        with pytest.raises(EnvironmentSetupError) as err:
            check_environment_class_source(spec, last_binding(path, "Game"), kwargs)
        assert err.value.message == message.format(spec=spec)
    with pytest.raises(EnvironmentSetupError, match="its __init__ takes no arguments"):
        check_environment_class_source(f"{path}:Plain", last_binding(path, "Plain"), {"tries": 3})
    check_environment_class_source(f"{path}:Open", last_binding(path, "Open"), {"anything": 1})  # **options takes all
