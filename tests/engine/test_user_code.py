"""engine/user_code.import_named: the one loader of reward functions, tools and environment classes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ppo_cli.engine.user_code import import_named
from ppo_cli.errors import EnvironmentSetupError, RewardFunctionError


def test_a_missing_file_is_one_line_and_the_hint_names_the_current_directory():
    with pytest.raises(RewardFunctionError) as info:
        import_named("nowhere/rewards.py:f", "reward function", RewardFunctionError)
    assert (info.value.message, info.value.hint) == (
        "reward function file not found: nowhere/rewards.py", f"paths are relative to the current directory ({Path.cwd()})")


def test_a_missing_name_suggests_the_closest_one_else_says_how_to_define_it(tmp_path):
    path = tmp_path / "tools.py"
    path.write_text("def calculate(expression):\n    return expression\n")
    with pytest.raises(EnvironmentSetupError) as info:
        import_named(f"{path}:calculat", "tool", EnvironmentSetupError)
    assert (info.value.message, info.value.hint) == (f"'{path}' has no tool 'calculat'", "did you mean 'calculate'?")
    with pytest.raises(RewardFunctionError) as info:
        import_named(f"{path}:score", "reward function", RewardFunctionError, kind="function", define="define def score")
    assert (info.value.message, info.value.hint) == (f"'{path}' has no function 'score'", "define def score")
    with pytest.raises(EnvironmentSetupError) as info:
        import_named(f"{path}:Game", "environment class", EnvironmentSetupError)
    assert info.value.hint == f"define Game in {path}"


def test_a_file_that_raises_is_one_line_and_raises_again_on_the_next_try(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('no board')\n")
    for _ in range(2):  # forgotten after failing: the second import runs the file again
        with pytest.raises(EnvironmentSetupError) as info:
            import_named(f"{path}:Game", "environment class", EnvironmentSetupError)
        assert info.value.message == f"cannot import environment class module '{path}': RuntimeError: no board"


def test_a_file_is_imported_once_and_runs_as_a_module_of_its_own(tmp_path):
    path = tmp_path / "shared.py"
    path.write_text("import dataclasses\n\n@dataclasses.dataclass\nclass Row:\n    answer: str\n\nRUNS = []\nRUNS.append(1)\n"
                    "def score(prompts, responses):\n    return [0.0] * len(responses)\n")
    row = import_named(f"{path}:Row", "tool", EnvironmentSetupError)  # a dataclass needs its module in sys.modules
    score = import_named(f"{path}:score", "reward function", RewardFunctionError)
    assert row("7").answer == "7" and score(["p"], ["r"]) == [0.0]
    module = sys.modules[row.__module__]
    assert module.RUNS == [1] and score.__module__ == row.__module__ and module.__file__ == str(path)


def test_a_module_path_imports_the_module_and_a_missing_one_says_how_to_name_a_file():
    assert import_named("ppo_cli.examples.rewards:positive_words", "reward function", RewardFunctionError).__name__ == (
        "positive_words")
    with pytest.raises(RewardFunctionError) as info:
        import_named("no_such_pkg.rewards:reward", "reward function", RewardFunctionError)
    assert info.value.message == ("cannot import reward function module 'no_such_pkg.rewards': ModuleNotFoundError: "
                                  "No module named 'no_such_pkg'")
    assert info.value.hint == ("a file is written path/to/file.py:reward; a module must be importable (installed, or on "
                               "PYTHONPATH)")


def test_a_file_imports_the_files_beside_it_and_a_missing_one_names_where_it_was_looked_for(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the directories added here go with the test
    package = tmp_path / "project"
    package.mkdir()
    (package / "ppo_test_helpers_45.py").write_text("def extract(text):\n    return text.strip()\n")
    (package / "rewards.py").write_text("from ppo_test_helpers_45 import extract\n"
                                        "def reward(completions, **kwargs):\n    return [float(extract(c) == '4') for c in completions]\n")
    reward = import_named(f"{package / 'rewards.py'}:reward", "reward function", RewardFunctionError)
    assert reward([" 4 ", "5"]) == [1.0, 0.0]
    assert sys.path[-1] == str(package)  # at the end: an installed package of the same name still wins
    (tmp_path / "alone.py").write_text("import ppo_no_such_helper_45\n")
    with pytest.raises(RewardFunctionError) as info:
        import_named(f"{tmp_path / 'alone.py'}:reward", "reward function", RewardFunctionError)
    assert info.value.message == (f"cannot import reward function module '{tmp_path / 'alone.py'}': ModuleNotFoundError: "
                                  "No module named 'ppo_no_such_helper_45'")
    assert info.value.hint == f"a module it imports must be installed, on PYTHONPATH or a file in {tmp_path}"
